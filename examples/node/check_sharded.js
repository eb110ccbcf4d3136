// Checks of qdelay.js's ShardedClient run by tests/test_cluster_etcd.py against a real
// cluster (etcd + servers in cluster mode).
//
//   node check_sharded.js SEED spread    sends spread over the shards, cancel/get by receipt,
//                                        a consumer receives from every shard
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
