// Checks of qdelay.js's ShardedClient run by tests/test_cluster_etcd.py against a real
// cluster (etcd + servers in cluster mode).
//
//   node check_sharded.js SEED spread    sends spread over the shards, cancel/get by receipt,
//                                        cancelMany over both shards (caller's order),
//                                        reschedule, rescheduleMany and get by receipt text, a consumer
//                                        receives from every shard (acks to their stream)
//   node check_sharded.js SEED follow    sends one after another until stdin closes, printing
//                                        "acked <message_id> <shard>"; then "sent N failed F"
'use strict';

const { ShardedClient } = require('./qdelay');

const [seed, mode] = process.argv.slice(2);
const client = new ShardedClient(seed, { backoffMs: 20, failoverMs: 30000 });

async function spread() {
  const now = Date.now();
  const receipts = await Promise.all([...Array(60).keys()].map((i) =>
    client.send('failover', `n${i}`, { deliverAtMs: now + 300 })));
  const shards = new Set(receipts.map((r) => r.shard));
  if (shards.size < 2) throw new Error(`one shard only: ${[...shards]}`);
  for (const r of receipts.slice(0, 5)) {
    const outcome = await client.cancel(r);
    if (outcome !== 'CANCELLED') throw new Error(`cancel: ${outcome}`);
  }
  const st = await client.get(receipts[10]);
  if (st.message.payload.toString() !== 'n10') throw new Error('get: wrong message');
  // more, due later: cancelMany grouped per shard, in the caller's order; the receipt text
  // and reschedule routed to the receipt's shard
  const later = await Promise.all([...Array(8).keys()].map((i) => client.send('failover.later', `l${i}`, { delayMs: 3600000 })));
  if (new Set(later.map((r) => r.shard)).size < 2) throw new Error('later: one shard only');
  const targets = [later[0], String(later[1]), later[2].message_id, 'no-such-id', later[3], later[0]];
  const outcomes = await client.cancelMany(targets, { batchSize: 2 });
  const want1 = ['CANCELLED', 'CANCELLED', 'CANCELLED', 'NOT_FOUND', 'CANCELLED', 'ALREADY_CANCELLED'];
  if (outcomes.join() !== want1.join()) throw new Error(`cancelMany: ${outcomes}`);
  const moved = await Promise.all(later.slice(4).map((r) => client.reschedule(String(r), { delayMs: 7200000 })));
  if (moved.some((m) => m.outcome !== 'RESCHEDULED' || m.receipt.shard === undefined)) throw new Error('reschedule');
  if ((await client.get(String(moved[0].receipt))).state !== 'PENDING') throw new Error('get by text');
  // rescheduleMany grouped per shard, answers in the caller's order
  const again = await client.rescheduleMany([...moved.map((m) => m.receipt), later[0]], { delayMs: 10800000, batchSize: 2 });
  const got = again.map((m) => m.outcome).join();
  if (got !== [...moved.map(() => 'RESCHEDULED'), 'CANCELLED'].join()) throw new Error(`rescheduleMany: ${got}`);
  if (again.slice(0, -1).some((m, i) => m.receipt.message_id !== moved[i].receipt.message_id)) throw new Error('rescheduleMany order');
  const want = new Set(receipts.slice(5).map((r) => r.message_id));
  const consumer = client.subscribe('failover', { group: 'node-sharded' });
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`${want.size} not delivered`)), 20000);
    consumer.on('batch', (deliveries) => {
      for (const d of deliveries) want.delete(d.message_id);
      consumer.ack(deliveries);
      if (!want.size) { clearTimeout(timer); resolve(); }
    });
  });
  await consumer.close();
  // every ack reached its own shard (two shards hand out the same ack ids)
  for (let tries = 0; ; tries += 1) {
    const states = await Promise.all(receipts.slice(5).map((r) => client.get(r).then((g) => g.state)));
    if (states.every((x) => x === 'DELIVERED')) break;
    if (tries > 100) throw new Error(`not acknowledged: ${states.filter((x) => x !== 'DELIVERED').length}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  console.log(`sharded: OK (${[...shards].sort().join(',')})`);
}

async function follow() {
  let done = false;
  process.stdin.on('end', () => { done = true; });
  process.stdin.resume();
  let sent = 0;
  let failed = 0;
  while (!done) {
    try {
      const r = await client.send('follow', 'x', { delayMs: 60000 });
      sent += 1;
      console.log(`acked ${r.message_id} ${r.shard}`);
    } catch (err) {
      failed += 1;
      console.error(`failed: ${err.message}`);
    }
  }
  console.log(`sent ${sent} failed ${failed} retries ${client.retries}`);
}

(mode === 'spread' ? spread() : follow())
  .then(() => client.close()).then(() => process.exit(0))
  .catch((err) => { console.error(`check failed: ${err.message}`); process.exit(1); });
