// qdelay from Node.js: send a delayed message, receive it at its due time, ack it,
// and cancel another one before it is due. grpc-js loads the .proto at run time.
//
//   cd examples/node && npm ci && node example.js [HOST:PORT]
//
// Environment: QDELAY_TOKEN (bearer token, when the server has --auth-token-file),
// QDELAY_TLS_CA (PEM file: connect with TLS). Exits 0 on success, 1 on any failure.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.join(__dirname, '..', '..', 'proto');
const target = process.argv[2] || process.env.QDELAY_ADDRESS || '127.0.0.1:7600';

const definition = protoLoader.loadSync(path.join(PROTO_ROOT, 'qdelay', 'v1', 'qdelay.proto'), {
  includeDirs: [PROTO_ROOT],
  keepCase: true, // field names as in the .proto: deliver_at_ms, message_id ...
  longs: String, // int64 / uint64 arrive as decimal strings
  enums: String, // outcome: 'CANCELLED', state: 'PENDING' ...
  defaults: true,
  oneofs: true,
});
const qdelay = grpc.loadPackageDefinition(definition).qdelay.v1;

const credentials = process.env.QDELAY_TLS_CA
  ? grpc.credentials.createSsl(fs.readFileSync(process.env.QDELAY_TLS_CA))
  : grpc.credentials.createInsecure();
const client = new qdelay.DelayService(target, credentials, {
  'grpc.max_receive_message_length': 80 * 1024 * 1024,
  'grpc.max_send_message_length': 80 * 1024 * 1024,
});

function metadata() {
  const md = new grpc.Metadata();
  if (process.env.QDELAY_TOKEN) md.set('authorization', `Bearer ${process.env.QDELAY_TOKEN}`);
  return md;
}

function unary(method, request, timeoutMs = 10000) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata(), { deadline: Date.now() + timeoutMs }, (err, response) =>
      err ? reject(new Error(`${method}: ${grpc.status[err.code]}: ${err.details}`)) : resolve(response));
  });
}

// Subscribe, collect `count` deliveries (acking each batch), then end the stream.
function receive(subject, count, timeoutMs) {
  return new Promise((resolve, reject) => {
    const call = client.Subscribe(metadata());
    const got = [];
    let ending = false;
    const timer = setTimeout(() => { call.cancel(); reject(new Error(`received ${got.length} of ${count}`)); },
      timeoutMs);
    call.on('data', (response) => {
      if (ending) return; // sent before the server saw the end of our stream: it gives them to others
      const at = Date.now();
      for (const d of response.deliveries) got.push({ ...d, received_at_ms: at });
      call.write({ ack_ids: response.deliveries.map((d) => d.ack_id) });
      if (got.length >= count) {
        ending = true;
        clearTimeout(timer);
        // half-close, not cancel: the server applies the acks written above, then ends the
        // stream (a cancel right after the write may drop them: delivered again later)
        call.end();
        const fallback = setTimeout(() => call.cancel(), 5000);
        call.on('status', () => { clearTimeout(fallback); resolve(got); });
      }
    });
    call.on('error', (err) => {
      if (err.code !== grpc.status.CANCELLED) { clearTimeout(timer); reject(err); }
    });
    call.write({ subject, group: 'node-example', max_in_flight: 100 });
  });
}

function check(condition, message) {
  if (!condition) throw new Error(`check failed: ${message}`);
}

async function main() {
  const subject = `node.example.${process.pid}`;

  // 1. send: one due in 500 ms (relative, on the server's clock), one to cancel
  const sent = await unary('Send', {
    message: { subject, payload: Buffer.from('hello from node'), headers: { lang: 'js' }, delay_ms: 500 },
  });
  const keep = sent.receipt;
  console.log(`sent ${keep.message_id} due at ${keep.deliver_at_ms} (sequence ${keep.sequence})`);

  const batch = await unary('SendBatch', {
    messages: [{ subject, payload: Buffer.from('cancel me'), deliver_at_ms: String(Date.now() + 1500) }],
  });
  const drop = batch.receipts[0];

  // 2. cancel before due
  const cancelled = await unary('Cancel', { receipt: drop });
  check(cancelled.outcome === 'CANCELLED', `cancel outcome ${cancelled.outcome}`);
  const state = await unary('Get', { receipt: drop });
  check(state.state === 'CANCELLED', `state after cancel ${state.state}`);
  console.log(`cancelled ${drop.message_id}`);

  // 3. receive at the due time, not before
  const [delivery] = await receive(subject, 1, 10000);
  check(delivery.message_id === keep.message_id, 'received the kept message');
  check(delivery.payload.toString() === 'hello from node', 'payload round trip');
  check(delivery.headers.lang === 'js', 'headers round trip');
  check(delivery.received_at_ms >= Number(keep.deliver_at_ms), 'not delivered early');
  console.log(`received ${delivery.message_id} attempt ${delivery.attempt}, ` +
    `${delivery.received_at_ms - Number(keep.deliver_at_ms)} ms after its due time`);

  // 4. too late to cancel now; bad input gets INVALID_ARGUMENT
  await new Promise((r) => setTimeout(r, 300));
  const late = await unary('Cancel', { receipt: keep });
  check(late.outcome === 'ALREADY_DELIVERED', `late cancel outcome ${late.outcome}`);
  try {
    await unary('Send', { message: { subject: 'bad subject!', delay_ms: 0 } });
    throw new Error('bad subject accepted');
  } catch (err) {
    check(/INVALID_ARGUMENT/.test(err.message), err.message);
  }
  const stats = await unary('Stats', {});
  console.log(`stats: role ${stats.role}, pending ${stats.pending}`);
  console.log('node example: OK');
}

main().then(() => { client.close(); process.exit(0); })
  .catch((err) => { console.error(`node example failed: ${err.message}`); client.close(); process.exit(1); });
