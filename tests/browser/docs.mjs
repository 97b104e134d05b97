// Opens behest's /docs in the system's headless Chromium (playwright-core) with every host but
// 127.0.0.1 unresolvable — the network "off" — and uses it: the reference renders from the
// embedded Swagger UI and the served /openapi.json, "Authorize" takes the API key, and "Try it
// out" on GET /providers gets a 200. Any request to another host fails the test.
// Usage: node docs.mjs <server url> <api key>
import { chromium } from 'playwright-core';

const [url, key] = process.argv.slice(2);
if (!url || !key) {
  console.error('usage: node docs.mjs <server url> <api key>');
  process.exit(2);
}

function check(condition, message) {
  if (!condition) throw new Error(message);
}

const browser = await chromium.launch({
  executablePath: process.env.BEHEST_TEST_CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--no-first-run',
    '--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1'],
});
const errors = [];
try {
  const page = await browser.newPage({ viewport: { width: 1200, height: 900 } });
  page.setDefaultTimeout(20000);
  page.on('pageerror', (error) => errors.push(String(error)));
  const elsewhere = [];
  page.on('request', (request) => {
    const host = new URL(request.url()).hostname;
    if (host !== '127.0.0.1' && !request.url().startsWith('data:')) elsewhere.push(request.url());
  });
  await page.goto(url + '/docs');
  await page.waitForSelector('.opblock');
  const operations = await page.locator('.opblock').count();
  check(operations >= 15, 'every operation is shown: ' + operations);
  const title = await page.locator('.info .title').first().textContent();
  check(title.includes('behest'), 'the document is behest\'s: ' + title);
  console.log('ok: the reference renders from the binary with the network off');

  await page.locator('button.authorize').first().click();
  const modal = page.locator('.modal-ux');
  // One form per security scheme (the bearer header, and `access_token` for event streams).
  const forms = modal.locator('.auth-container');
  for (let i = 0; i < await forms.count(); i++) {
    const form = forms.nth(i);
    await form.locator('input').first().fill(key);
    await form.locator('button.modal-btn.auth.authorize').first().click();
  }
  await modal.locator('button.btn-done').first().click();
  const providers = page.locator('#operations-providers-list_providers');
  await providers.locator('.opblock-summary').click();
  // "Try it out" is on from the start (the page's configuration).
  await providers.locator('button.execute').click();
  await providers.locator('.live-responses-table tr.response .response-col_status').first().waitFor();
  const status = (await providers.locator('.live-responses-table tr.response .response-col_status').first()
    .textContent()).trim();
  check(status.startsWith('200'), 'Try it out answered ' + status);
  console.log('ok: Authorize and Try it out call the API with the key');
  check(elsewhere.length === 0, 'requests to other hosts: ' + elsewhere.join(', '));
  check(errors.length === 0, 'page errors: ' + errors.join('; '));
  console.log('ok: nothing was fetched from another host');
} catch (error) {
  console.error('FAILED: ' + error.message);
  process.exitCode = 1;
} finally {
  await browser.close();
}
