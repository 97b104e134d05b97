// Drives the behest web console in the system's headless Chromium (playwright-core, no browser
// download). Usage: node console.mjs <server url> <cutting proxy url> [screenshot.png]
// tests/it/console.rs starts the server (demo model, no config) and the proxy, which cuts the
// first event stream it carries mid-run. Exits non-zero with a message on the first failure.
import { chromium } from 'playwright-core';

const [url, proxyUrl, screenshot] = process.argv.slice(2);
if (!url || !proxyUrl) {
  console.error('usage: node console.mjs <server url> <proxy url> [screenshot.png]');
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
async function open(base) {
  const page = await browser.newPage({ viewport: { width: 1100, height: 760 } });
  page.setDefaultTimeout(20000);
  page.on('pageerror', (error) => errors.push(String(error)));
  await page.goto(base + '/');
  await page.waitForSelector('#provider option[value="demo"]', { state: 'attached' });
  return page;
}
const text = (page, selector) => page.locator(selector).allTextContents();

try {
  // 1. A turn that calls the built-in tool, then answers from its result.
  const page = await open(url);
  await page.getByLabel('Your message').fill('What time is it?');
  await page.getByLabel('Your message').press('Enter');
  await page.waitForSelector('#state[data-state="completed"]');
  const tools = await text(page, '#transcript .tool');
  check(tools.length === 1 && tools[0].includes('Tool call: current_time'), 'tool call shown: ' + tools);
  check(tools[0].includes('"utc"'), 'tool result shown: ' + tools);
  const answers = await text(page, '#transcript .msg.assistant .text');
  check(answers.length === 1 && /^`current_time` answered \{.*"utc".*\}\.$/.test(answers[0]),
    'answer from the tool result: ' + JSON.stringify(answers));
  check((await text(page, '#transcript .note.usage')).length === 2, 'usage of both model calls');
  check((await text(page, '#transcript .note.terminal'))[0] === 'Run completed (stop, 2 model calls)',
    'terminal state shown');
  console.log('ok: a turn with a tool call streamed and completed');

  // The run is listed by its input; opening it replays it from the event log.
  await page.waitForFunction(() => /^“What time is it\?” · completed/.test(
    document.querySelector('#runs button')?.textContent || ''));
  await page.locator('#runs button').first().click();
  await page.waitForSelector('#transcript .note.terminal');
  await page.waitForSelector('#state[data-state="completed"]');
  const replayed = await text(page, '#transcript .msg.assistant .text');
  check(JSON.stringify(replayed) === JSON.stringify(answers), 'replay shows the same answer: ' + replayed);
  check((await text(page, '#transcript .msg.user .text'))[0] === 'What time is it?', 'replay shows the input');
  console.log('ok: opening a recent run replays it');
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });

  // 2. Text streams in while the run is active; Cancel stops it.
  await page.getByLabel('Your message').fill('Please count to 400');
  await page.getByRole('button', { name: 'Send' }).click();
  await page.waitForFunction(() => {
    const answers = document.querySelectorAll('#transcript .msg.assistant .text');
    const last = answers[answers.length - 1];
    return last && last.textContent.startsWith('1 2 3 4 5 ')
      && document.querySelector('#state').dataset.state === 'running';
  });
  console.log('ok: text streams while the run is running');
  await page.getByRole('button', { name: 'Cancel run' }).click();
  await page.waitForSelector('#state[data-state="cancelled"]');
  const partial = (await text(page, '#transcript .msg.assistant .text')).pop();
  check(!partial.includes(' 400.'), 'the cancelled run stopped before its end');
  check(partial.endsWith(' (incomplete)'), 'the cut text is marked incomplete live: ' + partial);
  console.log('ok: cancel stops a running run; its text is marked incomplete');

  // 3. The event stream is cut mid-run (by the proxy): the page reconnects by itself and shows
  // the complete answer exactly once.
  const cut = await open(proxyUrl);
  await cut.getByLabel('Your message').fill('count to 150');
  await cut.getByLabel('Your message').press('Enter');
  await cut.waitForSelector('#state[data-state="completed"]', { timeout: 30000 });
  const expected = Array.from({ length: 150 }, (_, i) => String(i + 1)).join(' ') + '.';
  const cutAnswers = await text(cut, '#transcript .msg.assistant .text');
  check(cutAnswers.length === 1 && cutAnswers[0] === expected,
    'complete answer exactly once after the cut: ' + JSON.stringify(cutAnswers));
  console.log('ok: after a cut stream the answer is complete, exactly once');

  // 4. A run that waits for you (a tool the client executes, a call that needs approval): the
  // console shows a form, and answering it resumes the run.
  const created = await (await fetch(url + '/runs', {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      provider: 'demo', model: 'demo', input: 'call get_location and call current_time',
      tools: ['current_time', { name: 'get_location', description: 'Where the user is' }],
      approval: ['current_time'],
    }),
  })).json();
  const waiting = await open(url);
  await waiting.locator('#runs button[data-run-id="' + created.run_id + '"]').click();
  await waiting.waitForSelector('#state[data-state="waiting"]');
  await waiting.getByLabel('Output of get_location').fill('{"city": "Paris"}');
  await waiting.getByLabel('Decision on current_time').selectOption('approve');
  await waiting.getByRole('button', { name: 'Answer the run' }).click();
  await waiting.waitForSelector('#state[data-state="completed"]');
  const resumed = (await text(waiting, '#transcript .msg.assistant .text')).pop();
  check(resumed.includes('`get_location` answered {"city":"Paris"}.')
    && resumed.includes('`current_time` answered {'), 'the answer uses both results: ' + resumed);
  check((await waiting.locator('form.action').count()) === 0, 'the form is gone once answered');
  console.log('ok: a run waiting for you is answered from the console');

  // 5. A long session, titled: listed by its title, opened at its newest messages (all of
  // them here: more than one page of 50), scrolled to the end.
  const post = async (path, body) => (await fetch(url + path, {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  })).json();
  const session = await post('/sessions', { title: 'Long talk' });
  for (let turn = 1; turn <= 30; turn += 1) {
    const run = await post('/runs', {
      provider: 'demo', model: 'demo', session_id: session.id, input: 'turn ' + turn + ': count to 1',
    });
    for (;;) {
      const record = await (await fetch(url + '/runs/' + run.run_id)).json();
      if (record.status === 'completed') break;
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
  }
  const long = await open(url);
  const listed = long.locator('#sessions button[data-session-id="' + session.id + '"]');
  check((await listed.textContent()).startsWith('Long talk · '), 'listed by title: '
    + await listed.textContent());
  await listed.click();
  await long.waitForSelector('#state[data-state="idle"]');
  const inputs = await text(long, '#transcript .msg.user .text');
  check(inputs.length === 30 && inputs[0] === 'turn 1: count to 1'
    && inputs[29] === 'turn 30: count to 1', 'every turn, oldest first: ' + inputs.length
    + ' ' + inputs[0] + ' … ' + inputs[inputs.length - 1]);
  const atEnd = await long.evaluate(() => {
    const last = document.querySelector('#transcript').lastElementChild.getBoundingClientRect();
    return last.bottom <= window.innerHeight + 1 && window.scrollY > 0;
  });
  check(atEnd, 'the newest message is in view');
  console.log('ok: a long titled session opens at its newest messages');

  // Readable at phone width: nothing wider than the viewport.
  await cut.setViewportSize({ width: 375, height: 700 });
  const overflow = await cut.evaluate(() => document.documentElement.scrollWidth);
  check(overflow <= 375, 'no horizontal scrolling at 375 px: ' + overflow);
  console.log('ok: fits a phone width');
  check(errors.length === 0, 'page errors: ' + errors.join('; '));
} catch (error) {
  console.error('FAILED: ' + error.message);
  process.exitCode = 1;
} finally {
  await browser.close();
}
