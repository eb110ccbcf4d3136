// Checks of qdelay.js run by the test suite (tests/test_node_example.py) against a real server.
//
//   node check_client.js HOST:PORT batching   concurrent sends, one invalid among them
//   node check_client.js HOST:PORT consume SUBJECT
//       prints "ready" once subscribed, then "got <message_id>" per delivery (acked) and
//       "reconnect <n>" when it subscribes again; runs until stdin closes.
'use strict';

const { Client } = require('./qdelay');

const [target, mode, subject] = process.argv.slice(2);
const client = new Client(target, { backoffMs: 50, retries: 30 });

async function batching() {
  const s = `node.batching.${process.pid}`;
  const results = await Promise.allSettled([...Array(300).keys()].map((i) =>
    client.send(i === 77 ? 'bad subject!' : s, `p${i}`, { delayMs: 3600000, messageId: `${s}-${i}` })));
  const failed = results.map((r, i) => [r, i]).filter(([r]) => r.status === 'rejected').map(([, i]) => i);
  if (failed.join() !== '77') throw new Error(`failed: ${failed.join()}`);
  if (!/INVALID_ARGUMENT/.test(results[77].reason.message)) throw new Error(results[77].reason.message);
  results.forEach((r, i) => {
    if (i !== 77 && r.value.message_id !== `${s}-${i}`) throw new Error(`receipt ${i} is another caller's`);
  });
  const seqs = new Set(results.filter((r) => r.status === 'fulfilled').map((r) => r.value.sequence));
  if (seqs.size !== 299) throw new Error(`${seqs.size} distinct sequences`);
  const st = await client.get(results[5].value);
  if (st.state !== 'PENDING' || st.message.payload.toString() !== 'p5') throw new Error(`get: ${st.state}`);
  console.log(`batching: OK (${client.sender.batches} batches, ${client.sender.streams} streams)`);
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

(mode === 'batching' ? batching() : consume())
  .then(() => client.close()).then(() => process.exit(0))
  .catch((err) => { console.error(`check failed: ${err.message}`); process.exit(1); });
