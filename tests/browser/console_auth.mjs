// Drives the behest web console with API keys on, in the system's headless Chromium
// (playwright-core). Usage: node console_auth.mjs <server url> <api key>
// tests/it/console.rs starts the server (demo model, `BEHEST_AUTH__KEYS` set). The page loads
// without a key (it holds no data), says the API needs one, and works once it is entered:
// requests carry `Authorization: Bearer`, the event stream `?access_token=`.
import { chromium } from 'playwright-core';

const [url, key] = process.argv.slice(2);
if (!url || !key) {
  console.error('usage: node console_auth.mjs <server url> <api key>');
  process.exit(2);
}

function check(condition, message) {
  if (!condition) throw new Error(message);
}

const browser = await chromium.launch({
  executablePath: process.env.BEHEST_TEST_CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--no-first-run'],
});
const errors = [];
try {
  const context = await browser.newContext();
  const page = await context.newPage();
  page.setDefaultTimeout(20000);
  page.on('pageerror', (error) => errors.push(String(error)));
  const seen = [];
  page.on('request', (request) => {
    const path = new URL(request.url()).pathname;
    if (path === '/' || path.startsWith('/console/')) return;
    seen.push({ url: request.url(), auth: request.headers()['authorization'] || '' });
  });
  await page.goto(url + '/');
  await page.waitForSelector('#transcript .note.error');
  const refused = (await page.locator('#transcript .note.error').allTextContents()).join(' ');
  check(/API key/i.test(refused), 'the page says a key is needed: ' + refused);
  console.log('ok: without a key the page says the API needs one');

  check(await page.locator('details').evaluate((d) => d.open), 'the API key box is opened');
  await page.getByLabel(/Key \(kept in this browser/).fill(key);
  await page.getByLabel(/Key \(kept in this browser/).press('Enter');
  await page.waitForSelector('#provider option[value="demo"]', { state: 'attached' });
  console.log('ok: with the key the providers load');
  await page.waitForFunction(() => document.querySelectorAll('#transcript .note.error').length === 0);
  console.log('ok: the notes that asked for a key are gone once it works');

  await page.getByLabel('Your message').fill('What time is it?');
  await page.getByLabel('Your message').press('Enter');
  await page.waitForSelector('#state[data-state="completed"]');
  const answers = await page.locator('#transcript .msg.assistant .text').allTextContents();
  check(answers.length === 1 && answers[0].startsWith('`current_time` answered {'),
    'the run streamed its answer: ' + JSON.stringify(answers));
  console.log('ok: a run streams and completes with auth on');

  const streams = seen.filter((r) => new URL(r.url).pathname.endsWith('/events'));
  check(streams.length >= 1, 'an event stream was opened');
  check(streams.every((r) => new URL(r.url).searchParams.get('access_token') === key),
    'event streams carry ?access_token=');
  const calls = seen.filter((r) => !new URL(r.url).pathname.endsWith('/events'));
  check(calls.length >= 3 && calls.slice(-3).every((r) => r.auth === 'Bearer ' + key),
    'API calls carry Authorization: Bearer: ' + JSON.stringify(calls.map((c) => c.auth)));
  console.log('ok: calls send the key as a header, event streams as ?access_token=');

  // Kept in this browser: a reload needs no typing.
  await page.reload();
  await page.waitForSelector('#provider option[value="demo"]', { state: 'attached' });
  check(!page.url().includes(key), 'the key is not in the page URL');
  console.log('ok: the key is remembered across a reload');
  check(errors.length === 0, 'page errors: ' + errors.join('; '));
} catch (error) {
  console.error('FAILED: ' + error.message);
  process.exitCode = 1;
} finally {
  await browser.close();
}
