// The Node module's ShardedClient (examples/node/qdelay.js) driven by bench/shards.py:
//
//   node bench/shards_node.js SEED
//
// reads one command a line from stdin and answers each with one JSON line
// {"ops": N, "wall_s": ..., "cpu_s": ...} (cpu_s: this process's user + system CPU), so
// that the Python side can read the servers' CPU around each command:
//
//   send N BASE      N concurrent send() of far-future messages (the client batches them
//                    per shard on SendStream); keeps the receipts
//   cancelMany       cancelMany of every other kept receipt (grouped per shard)
//   rescheduleMany   rescheduleMany of the other half (grouped per shard) an hour later
//   getReceipt N     N get() one after another, of kept receipts (routed by their shard)
//   getId N          N get() by message id alone (routed by the id's CRC-32)
//   refresh N        N refresh() (one Topology call each)
'use strict';

const path = require('path');
const readline = require('readline');

const { ShardedClient } = require(path.join(__dirname, '..', 'examples', 'node', 'qdelay'));

const client = new ShardedClient(process.argv[2]);
let receipts = [];
let seed = 1;
const pick = () => {
  seed = (seed * 1103515245 + 12345) % 2147483648; // deterministic, cheap
  return receipts[seed % receipts.length];
};

async function run(op, n, base) {
  switch (op) {
    case 'send': {
      const payload = Buffer.alloc(100, 'x');
      receipts = await Promise.all([...Array(n).keys()].map((i) =>
        client.send('bench.node', payload, { deliverAtMs: base + i })));
      return n;
    }
    case 'cancelMany': {
      const doomed = receipts.filter((_r, i) => i % 2 === 0);
      const out = await client.cancelMany(doomed);
      const bad = out.filter((o) => o !== 'CANCELLED').length;
      if (bad) throw new Error(`cancelMany: ${bad} not CANCELLED`);
      return doomed.length;
    }
    case 'rescheduleMany': {
      const kept = receipts.filter((_r, i) => i % 2 === 1);
      const out = await client.rescheduleMany(kept, { delayMs: 3600000 });
      const bad = out.filter((o) => o.outcome !== 'RESCHEDULED').length;
      if (bad) throw new Error(`rescheduleMany: ${bad} not RESCHEDULED`);
      receipts = out.map((o) => o.receipt); // the pending ones, at their new place
      return kept.length;
    }
    case 'getReceipt':
      for (let i = 0; i < n; i += 1) await client.get(pick());
      return n;
    case 'getId':
      for (let i = 0; i < n; i += 1) await client.get(pick().message_id);
      return n;
    case 'refresh':
      for (let i = 0; i < n; i += 1) await client.refresh();
      return n;
    default:
      throw new Error(`unknown command ${op}`);
  }
}

async function main() {
  await client.refresh();
  const lines = readline.createInterface({ input: process.stdin });
  for await (const line of lines) {
    const [op, n, base] = line.trim().split(' ');
    const cpu0 = process.cpuUsage();
    const t0 = process.hrtime.bigint();
    const ops = await run(op, Number(n || 0), Number(base || 0));
    const wall = Number(process.hrtime.bigint() - t0) / 1e9;
    const cpu = process.cpuUsage(cpu0);
    process.stdout.write(`${JSON.stringify({ ops, wall_s: wall, cpu_s: (cpu.user + cpu.system) / 1e6 })}\n`);
  }
  await client.close();
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
