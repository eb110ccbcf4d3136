// Checks of qdelay.js run by the test suite (tests/test_node_example.py) against a real server.
//
//   node check_client.js HOST:PORT batching   concurrent sends, one invalid among them
//   node check_client.js HOST:PORT consume SUBJECT
//       prints "ready" once subscribed, then "got <message_id>" per delivery (acked) and
//       "reconnect <n>" when it subscribes again; runs until stdin closes.
//   node check_client.js HOST:PORT receipts SUBJECT PYTHON_RECEIPT_TEXT
//       receipt text both ways (cancels the Python client's receipt by its text, prints
//       "text <its own receipt's text>" and "rescheduled <the new receipt's text>"),
//       reschedule, cancelMany and rescheduleMany across batches, in the caller's order.
//   node check_client.js HOST:PORT cancel RECEIPT_TEXT [many]
//       cancel() (or cancelMany([it]) with "many") with retries; prints "outcome <OUTCOME>".
'use strict';

const { Client, parseReceipt } = require('./qdelay');

const [target, mode, subject, pythonText] = process.argv.slice(2);
const client = new Client(target, { backoffMs: 50, retries: 30 });

async function batching() {
  const s = `node.batching.${process.pid}`;
  const results = await Promise.allSettled([...Array(300).keys()].map((i) =>
    client.send(i === 77 ? 'bad subject!' : s, `p${i}`, { delayMs: 3600000, messageId: `${s}-${i}` })));
  const failed = results.map((r, i) => [r, i]).filter(([r]) => r.status === 'rejected').map(([, i]) => i);
  if (failed.join() !== '77') throw new Error(`failed: ${failed.join()}`);
  // the field of the caller's own message, as unary Send names it, not messages[0] of a batch
  if (!/INVALID_ARGUMENT: message\.subject:/.test(results[77].reason.message)) throw new Error(results[77].reason.message);
  results.forEach((r, i) => {
    if (i !== 77 && r.value.message_id !== `${s}-${i}`) throw new Error(`receipt ${i} is another caller's`);
  });
  const seqs = new Set(results.filter((r) => r.status === 'fulfilled').map((r) => r.value.sequence));
  if (seqs.size !== 299) throw new Error(`${seqs.size} distinct sequences`);
  const st = await client.get(results[5].value);
  if (st.state !== 'PENDING' || st.message.payload.toString() !== 'p5') throw new Error(`get: ${st.state}`);
  console.log(`batching: OK (${client.sender.batches} batches, ${client.sender.streams} streams)`);
}

function expect(what, got, want) {
  if (JSON.stringify(got) !== JSON.stringify(want)) throw new Error(`${what}: ${JSON.stringify(got)}, not ${JSON.stringify(want)}`);
}

async function receipts() {
  expect('cancel by the Python text', await client.cancel(pythonText), 'CANCELLED');
  const r = await client.send(subject, 'kept', { delayMs: 3600000 });
  const text = String(r);
  expect('text parses back', String(parseReceipt(text)), text);
  console.log(`text ${text}`);
  expect('get by text', (await client.get(text)).state, 'PENDING');
  const moved = await client.reschedule(text, { delayMs: 7200000 });
  expect('reschedule', moved.outcome, 'RESCHEDULED');
  if (BigInt(moved.receipt.deliver_at_ms) <= BigInt(r.deliver_at_ms)) throw new Error('rescheduled earlier');
  console.log(`rescheduled ${String(moved.receipt)}`);
  expect('reschedule a cancelled one', (await client.reschedule(pythonText, { delayMs: 1 })).outcome, 'CANCELLED');
  const rs = await Promise.all([0, 1, 2].map((i) => client.send(subject, `m${i}`, { delayMs: 3600000 })));
  const outcomes = await client.cancelMany([rs[0], String(rs[1]), rs[2].message_id, 'no-such-id', rs[0]], { batchSize: 2 });
  expect('cancelMany', outcomes, ['CANCELLED', 'CANCELLED', 'CANCELLED', 'NOT_FOUND', 'ALREADY_CANCELLED']);
  const ms = await Promise.all([0, 1, 2].map((i) => client.send(subject, `r${i}`, { delayMs: 3600000 })));
  const many = await client.rescheduleMany([ms[0], String(ms[1]), ms[2].message_id, rs[0]], { delayMs: 7200000, batchSize: 3 });
  expect('rescheduleMany', many.map((m) => m.outcome), ['RESCHEDULED', 'RESCHEDULED', 'RESCHEDULED', 'CANCELLED']);
  many.slice(0, 3).forEach((m, i) => {
    if (m.receipt.message_id !== ms[i].message_id || BigInt(m.receipt.deliver_at_ms) <= BigInt(ms[i].deliver_at_ms)) {
      throw new Error(`rescheduleMany[${i}]: ${String(m.receipt)}`);
    }
  });
  if (many[3].receipt !== null) throw new Error('rescheduleMany of a cancelled one has a receipt');
  // any iterable, as the Python clients take: a Set or a generator used to answer [] and
  // move or cancel nothing
  const it = await Promise.all([0, 1].map((i) => client.send(subject, `s${i}`, { delayMs: 3600000 })));
  const viaSet = await client.rescheduleMany(new Set(it.map(String)), { delayMs: 7200000 });
  expect('rescheduleMany of a Set', viaSet.map((m) => m.outcome), ['RESCHEDULED', 'RESCHEDULED']);
  const viaGenerator = await client.cancelMany((function* moved() { yield* viaSet.map((m) => m.receipt); }()));
  expect('cancelMany of a generator', viaGenerator, ['CANCELLED', 'CANCELLED']);
  try {
    await client.rescheduleMany([ms[0]], {});
    throw new Error('rescheduleMany without a time was sent');
  } catch (err) {
    expect('rescheduleMany without a time', err.code, 'INVALID_ARGUMENT');
  }
  try {
    parseReceipt('qd1:x');
    throw new Error('a bad text parsed');
  } catch (err) {
    expect('a bad text', err.code, 'INVALID_ARGUMENT');
  }
  for (const cut of [text.slice(0, 20), '']) { // a receipt cut short by a narrow column; nothing
    try {
      await client.cancel(cut);
      throw new Error(`cancel(${JSON.stringify(cut)}) was sent`);
    } catch (err) {
      expect(`cancel(${JSON.stringify(cut)})`, err.code, 'INVALID_ARGUMENT');
    }
  }
  expect('the cut text cancelled nothing', (await client.get(moved.receipt)).state, 'PENDING');
  console.log('receipts: OK');
}

async function cancel() {
  const text = subject;
  const outcome = pythonText === 'many' ? (await client.cancelMany([text]))[0] : await client.cancel(text);
  console.log(`outcome ${outcome}`);
}

function consume() {
  const consumer = client.subscribe(subject, { group: 'node-check', maxInFlight: 50 });
  consumer.on('batch', (deliveries) => {
    for (const d of deliveries) console.log(`got ${d.message_id}`);
    consumer.ack(deliveries);
  });
  consumer.on('reconnect', (n) => console.log(`reconnect ${n}`));
  consumer.on('error', (err) => { console.error(err.message); process.exit(1); });
  setTimeout(() => console.log('ready'), 300);
  return new Promise((resolve) => {
    process.stdin.on('end', resolve);
    process.stdin.resume();
  }).then(() => consumer.close()).then(() => console.log(`closed after ${consumer.reconnects} reconnects`));
}

({ batching, receipts, cancel }[mode] || consume)()
  .then(() => client.close()).then(() => process.exit(0))
  .catch((err) => { console.error(`check failed: ${err.message}`); process.exit(1); });
