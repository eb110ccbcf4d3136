// qdelay from Node.js with the module next to it (qdelay.js): send a delayed message,
// receive it at its due time, ack it, cancel another one before it is due, and send many
// concurrently through the batching send().
//
//   cd examples/node && npm ci && node example.js [HOST:PORT]
//
// Environment: QDELAY_TOKEN (bearer token, when the server has --auth-token-file),
// QDELAY_TLS_CA (PEM file: connect with TLS). Exits 0 on success, 1 on any failure.
'use strict';

const { Client } = require('./qdelay');

const target = process.argv[2] || process.env.QDELAY_ADDRESS || '127.0.0.1:7600';
const client = new Client(target, { token: process.env.QDELAY_TOKEN, tlsCa: process.env.QDELAY_TLS_CA });

function check(condition, message) {
  if (!condition) throw new Error(`check failed: ${message}`);
}

// Collect `count` deliveries of a new consumer (acking each batch), then close it.
function receive(subject, count, timeoutMs, group = 'node-example') {
  const consumer = client.subscribe(subject, { group, maxInFlight: 100 });
  return new Promise((resolve, reject) => {
    const got = [];
    const timer = setTimeout(() => { consumer.close(); reject(new Error(`received ${got.length} of ${count}`)); },
      timeoutMs);
    consumer.on('error', (err) => { clearTimeout(timer); reject(err); });
    consumer.on('batch', (deliveries) => {
      const at = Date.now();
      for (const d of deliveries) got.push({ ...d, received_at_ms: at });
      consumer.ack(deliveries);
      if (got.length >= count) {
        clearTimeout(timer);
        consumer.close().then(() => resolve(got)); // half-close: the acks above are applied first
      }
    });
  });
}

async function main() {
  const subject = `node.example.${process.pid}`;

  // 1. send: one due in 500 ms (relative, on the server's clock), one to cancel
  const keep = await client.send(subject, 'hello from node', { headers: { lang: 'js' }, delayMs: 500 });
  console.log(`sent ${keep.message_id} due at ${keep.deliver_at_ms} (sequence ${keep.sequence})`);
  const drop = await client.send(subject, 'cancel me', { deliverAtMs: Date.now() + 1500 });

  // 2. cancel before due
  const cancelled = await client.cancel(drop);
  check(cancelled === 'CANCELLED', `cancel outcome ${cancelled}`);
  const state = await client.get(drop);
  check(state.state === 'CANCELLED', `state after cancel ${state.state}`);
  console.log(`cancelled ${drop.message_id}`);

  // 2b. cancel by your own key, without keeping the receipt (e.g. an order number)
  const orderId = `order-${process.pid}-42`;
  await client.send(subject, 'order timeout', { messageId: orderId, delayMs: 3600000 });
  const byId = await client.cancel(orderId);
  check(byId === 'CANCELLED', `cancel by id outcome ${byId}`);
  check((await client.get(orderId)).state === 'CANCELLED', 'state by id after cancel');
  console.log(`cancelled ${orderId} by its id`);

  // 3. receive at the due time, not before
  const [delivery] = await receive(subject, 1, 10000);
  check(delivery.message_id === keep.message_id, 'received the kept message');
  check(delivery.payload.toString() === 'hello from node', 'payload round trip');
  check(delivery.headers.lang === 'js', 'headers round trip');
  check(delivery.received_at_ms >= Number(keep.deliver_at_ms), 'not delivered early');
  console.log(`received ${delivery.message_id} attempt ${delivery.attempt}, ` +
    `${delivery.received_at_ms - Number(keep.deliver_at_ms)} ms after its due time`);

  // 3b. fan-out: two consumer groups (say billing and notifications) each get every message
  const fan = `${subject}.fan`;
  const billing = receive(fan, 3, 10000, 'billing');
  const notify = receive(fan, 3, 10000, 'notify');
  for (let i = 0; i < 100; i += 1) { // both groups exist once their first Subscribe is in
    const groups = ((await client.stats()).groups || []).filter((g) => g.subject === fan);
    if (groups.length === 2) break;
    await new Promise((r) => setTimeout(r, 20));
  }
  const sentFan = await Promise.all([0, 1, 2].map((i) => client.send(fan, `fan ${i}`, { delayMs: 200 })));
  const wanted = sentFan.map((r) => r.message_id).sort().join();
  for (const [name, got] of [['billing', await billing], ['notify', await notify]]) {
    check(got.map((d) => d.message_id).sort().join() === wanted, `group ${name} got every message`);
  }
  console.log('two groups each received all 3 messages');

  // 4. too late to cancel now; bad input gets INVALID_ARGUMENT
  await new Promise((r) => setTimeout(r, 300));
  const late = await client.cancel(keep);
  check(late === 'ALREADY_DELIVERED', `late cancel outcome ${late}`);
  try {
    await client.send('bad subject!', '');
    throw new Error('bad subject accepted');
  } catch (err) {
    check(/INVALID_ARGUMENT/.test(err.message), err.message);
  }

  // 5. many concurrent sends share SendStream batches; each gets its own receipt
  const many = await Promise.all([...Array(500).keys()].map((i) =>
    client.send(subject, `m${i}`, { delayMs: 3600000, messageId: `${subject}-m${i}` })));
  check(many.every((r, i) => r.message_id === `${subject}-m${i}`), 'each caller its own receipt');
  console.log(`sent 500 concurrently in ${client.sender.batches} batches`);

  const stats = await client.stats();
  console.log(`stats: role ${stats.role}, pending ${stats.pending}`);
  console.log('node example: OK');
}

main().then(() => client.close()).then(() => process.exit(0))
  .catch((err) => { console.error(`node example failed: ${err.message}`); process.exit(1); });
