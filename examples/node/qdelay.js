// qdelay for Node.js: a small reusable client module (grpc-js, the .proto loaded at run time).
//
//   const { Client } = require('./qdelay');
//   const client = new Client('127.0.0.1:7600', { token: process.env.QDELAY_TOKEN });
//   const receipt = await client.send('order.close', Buffer.from('42'), { delayMs: 30 * 60 * 1000 });
//   await client.cancel(receipt);                 // or String(receipt), or receipt.message_id
//   row.receipt = String(receipt);                // 'qd1:…', the Python clients' text too
//   await client.reschedule(parseReceipt(row.receipt), { delayMs: 60000 });
//   await client.cancelMany([r1, String(r2), 'some-id']);   // outcomes in order
//   await client.rescheduleMany([r3, 'other-id'], { delayMs: 60000 });  // answers in order
//   const consumer = client.subscribe('order.close', { group: 'billing', maxInFlight: 100 });
//   consumer.on('batch', (deliveries) => { handle(deliveries); consumer.ack(deliveries); });
//   ...
//   await consumer.close(); client.close();
//
// What it shows a client author (docs/api.md, "Writing a client"):
// - send() gathers concurrent calls into SendStream batches (compact receipts, every
//   message with its own client-made id), sends a batch at once when the stream is idle
//   and lets one wait at most lingerMs while another is unanswered; a bounded queue
//   (maxQueued) makes send() wait instead of growing without end;
// - a refused batch (INVALID_ARGUMENT) is sent again one message per batch, so a bad
//   message fails only its own caller; a stream broken with UNAVAILABLE is reopened with
//   backoff and its unanswered batches sent again with the same ids;
// - a consumer acks in batches, keeps its credit, and subscribes again with backoff when the
//   server goes away (SIGTERM drain or crash); it ends only on close().
// - the server's address is checked when a client is made (checkTarget: HOST:PORT or a gRPC
//   target; a URL is refused naming the HOST:PORT to pass), not at the first call.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const zlib = require('zlib');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { EventEmitter } = require('events');

const PROTO_ROOT = path.join(__dirname, '..', '..', 'proto');
const MAX_BACKOFF_MS = 2000;

let service = null;
function loadService() {
  if (service === null) {
    const definition = protoLoader.loadSync(path.join(PROTO_ROOT, 'qdelay', 'v1', 'qdelay.proto'), {
      includeDirs: [PROTO_ROOT],
      keepCase: true, // field names as in the .proto: deliver_at_ms, message_id ...
      longs: String, // int64 / uint64 arrive as decimal strings
      enums: String, // outcome: 'CANCELLED', state: 'PENDING' ...
      defaults: true,
      oneofs: true,
    });
    service = grpc.loadPackageDefinition(definition).qdelay.v1.DelayService;
  }
  return service;
}

class QdelayError extends Error {
  constructor(method, err) {
    super(`${method}: ${grpc.status[err.code] || err.code}: ${err.details || err.message}`);
    this.code = grpc.status[err.code] || String(err.code);
    this.details = err.details || err.message;
  }
}

// A refusal of a batch of one send() message, worded as unary Send words it: the server
// names the field by its index in the batch (messages[0].subject: ...), a batch the caller
// never made; send()'s caller sees message.subject: ... (as the Python clients' own_field).
function ownField(err) {
  const details = err.details || '';
  return details.startsWith('messages[0].') ? { code: err.code, details: `message${details.slice('messages[0]'.length)}` } : err;
}

const backoff = (attempt, baseMs) => Math.min(baseMs * 2 ** (attempt - 1), MAX_BACKOFF_MS);

// Receipts users can keep (a database column): the same text as the Python clients'
// str(receipt) / Receipt.parse(text), qd1:<sequence>:<deliver_at_ms>:<shard>:<message_id>,
// the shard percent-quoted as Python's quote(shard, safe='') does and the id last, as it is
// (it may hold ':'). Receipts this module returns print that text (String(receipt)).
const RECEIPT_TEXT = /^qd1:(\d+):(-?\d+):([^:]*):([\s\S]+)$/;
const quote = (text) => encodeURIComponent(text)
  .replace(/[!'()*]/g, (c) => `%${c.charCodeAt(0).toString(16).toUpperCase()}`);

function receiptString(r) {
  return `qd1:${BigInt(r.sequence)}:${BigInt(r.deliver_at_ms)}:${quote(r.shard || '')}:${r.message_id}`;
}

// A receipt object with its text as toString (not enumerable: not sent on the wire).
function withText(r) {
  Object.defineProperty(r, 'toString', { value() { return receiptString(this); }, enumerable: false });
  return r;
}

function parseReceipt(text) {
  const m = typeof text === 'string' ? RECEIPT_TEXT.exec(text) : null;
  if (!m) {
    throw new QdelayError('parseReceipt', {
      code: grpc.status.INVALID_ARGUMENT,
      details: `not a qdelay receipt string: ${JSON.stringify(text)} (expected ` +
        "'qd1:<sequence>:<deliver_at_ms>:<shard>:<message_id>', as String(receipt) writes it)",
    });
  }
  return withText({
    message_id: m[4], deliver_at_ms: String(BigInt(m[2])), sequence: String(BigInt(m[1])), shard: decodeURIComponent(m[3]),
  });
}

// What names a message (cancel, get, reschedule take it): a receipt object, its text, or
// the message id alone (the newest message with that id). A text that starts with 'qd1:'
// is a receipt's and must parse: one cut short (a narrow column) sent as an id would answer
// NOT_FOUND while the message stays pending (docs/api.md, "Writing a client", 6).
function ref(target) {
  if (typeof target === 'string') {
    if (target === '') {
      throw new QdelayError('ref', {
        code: grpc.status.INVALID_ARGUMENT,
        details: 'receipt: empty string; give a receipt, its text (qd1:…) or the message id',
      });
    }
    return target.startsWith('qd1:') ? { receipt: parseReceipt(target) } : { message_id: target };
  }
  return { receipt: target };
}

// A CancelResponse of a cancel tried again: its first try may have cancelled the message.
function firstTry(r) {
  return r.outcome === 'ALREADY_CANCELLED' ? { ...r, outcome: 'CANCELLED' } : r;
}

// A RescheduleRequest for target at opts' one new time (deliverAtMs or delayMs).
function rescheduleRequest(method, target, opts) {
  if ((opts.deliverAtMs === undefined) === (opts.delayMs === undefined)) {
    throw new QdelayError(method, { code: grpc.status.INVALID_ARGUMENT, details: 'give one of deliverAtMs or delayMs' });
  }
  const request = ref(target);
  if (opts.deliverAtMs !== undefined) request.deliver_at_ms = String(opts.deliverAtMs);
  else request.delay_ms = String(opts.delayMs);
  return request;
}

// A RescheduleResponse as callers get it: {outcome, receipt} (receipt null unless RESCHEDULED).
function rescheduled(r) {
  return { outcome: r.outcome, receipt: r.outcome === 'RESCHEDULED' ? withText(r.receipt) : null };
}
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// A server's address, checked when a client is made, with the Python clients' check and words
// (qdelay/addresses.py check_target): HOST:PORT, or a gRPC target with a scheme: unix:PATH,
// unix-abstract:NAME, vsock:CID:PORT as they are; dns:[//AUTHORITY/]HOST:PORT, ipv4:/ipv6:
// lists with their ports. grpc-js took anything: 'http://host:7600' failed only at the first
// call, when the name 'http' could not be resolved (UNAVAILABLE, far from the cause), and an
// address without its port was tried on port 443. A URL's scheme:// is refused naming the
// HOST:PORT to pass.
const PATH_SCHEMES = ['unix:', 'unix-abstract:', 'vsock:'];
const ENDPOINT_SCHEMES = ['dns:', 'ipv4:', 'ipv6:'];
const URL_SCHEME = /^([A-Za-z][A-Za-z0-9+.-]*):\/\//;

// Python's repr() of a string, so that the messages read as the Python clients' do.
function pyRepr(text) {
  const escaped = text.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/\r/g, '\\r').replace(/\t/g, '\\t');
  if (text.includes("'") && !text.includes('"')) return `"${escaped}"`;
  return `'${escaped.replace(/'/g, "\\'")}'`;
}

function badTarget(details) {
  return new QdelayError('Client', { code: grpc.status.INVALID_ARGUMENT, details });
}

function refuseUrl(text, what, takes = '') {
  const found = URL_SCHEME.exec(text);
  if (found) {
    const bare = text.slice(found[0].length).split('/')[0]; // 'http://host:7600/' -> 'host:7600'
    throw badTarget(`${what} must be HOST:PORT${takes}, not ${pyRepr(text)}: gRPC takes no URL, drop the ` +
      `${found[1]}://; pass ${pyRepr(bare || 'HOST:PORT')}`);
  }
}

function checkHostPort(text, what) {
  refuseUrl(text, what);
  const cut = text.lastIndexOf(':');
  const host = cut < 0 ? '' : text.slice(0, cut);
  const port = cut < 0 ? text : text.slice(cut + 1);
  if (cut < 0 || !host.replace(/^[[\]]+|[[\]]+$/g, '') || port.includes(']') || host.includes('/')) {
    throw badTarget(`${what} must be HOST:PORT, not ${pyRepr(text)}`);
  }
  if (!/^\s*[+-]?\d+(_\d+)*\s*$/.test(port)) { // what Python's int() takes
    throw badTarget(`${what} must be HOST:PORT, not ${pyRepr(text)}: the port ${pyRepr(port)} is not a number`);
  }
  const number = Number(port.trim().replace(/_/g, ''));
  if (!(number >= 1 && number <= 65535)) {
    throw badTarget(`${what} must be HOST:PORT, not ${pyRepr(text)}: the port is not from 1 to 65535`);
  }
}

function checkTarget(target, what = 'target') {
  if (typeof target !== 'string') {
    const kind = target === null || target === undefined ? String(target) : target.constructor?.name || typeof target;
    throw badTarget(`${what} must be a HOST:PORT string, not ${kind}`);
  }
  if (PATH_SCHEMES.some((s) => target.startsWith(s))) return target;
  const scheme = ENDPOINT_SCHEMES.find((s) => target.startsWith(s));
  if (!scheme) refuseUrl(target, what, ' (or a gRPC target: unix:, dns:, ipv4:, ...)');
  let endpoints = [target];
  if (scheme === 'dns:') {
    const rest = target.slice(4);
    if (rest.startsWith('//')) {
      const slash = rest.indexOf('/', 2);
      endpoints = [slash < 0 ? '' : rest.slice(slash + 1)];
    } else {
      endpoints = [rest];
    }
  } else if (scheme) {
    endpoints = target.slice(scheme.length).split(',');
  }
  const named = endpoints.length === 1 && endpoints[0] === target ? what : `${what} ${pyRepr(target)}: its endpoint`;
  for (const endpoint of endpoints) checkHostPort(endpoint, named);
  return target;
}

class Client {
  constructor(target = '127.0.0.1:7600', options = {}) {
    checkTarget(target); // at once, not at the first call (checkTarget)
    const Service = loadService();
    const credentials = options.tlsCa
      ? grpc.credentials.createSsl(fs.readFileSync(options.tlsCa))
      : grpc.credentials.createInsecure();
    this.stub = new Service(target, credentials, {
      'grpc.max_receive_message_length': 80 * 1024 * 1024,
      'grpc.max_send_message_length': 80 * 1024 * 1024,
      'grpc.keepalive_time_ms': 30000, // find a dead connection on an idle stream
      'grpc.keepalive_permit_without_calls': 0,
    });
    this.token = options.token || null;
    this.timeoutMs = options.timeoutMs || 30000;
    this.retries = options.retries === undefined ? 5 : options.retries;
    this.backoffMs = options.backoffMs || 50;
    this.batching = options.batching === false ? null : {
      maxBatch: 1000, lingerMs: 1, maxInFlight: 4, maxQueued: 10000, ...(options.batching || {}),
    };
    this.idPrefix = `n${crypto.randomBytes(8).toString('hex')}-`;
    this.idCount = 0;
    this.sender = null;
    this.consumers = new Set();
  }

  metadata() {
    const md = new grpc.Metadata();
    if (this.token) md.set('authorization', `Bearer ${this.token}`);
    return md;
  }

  newId() {
    this.idCount += 1;
    return this.idPrefix + this.idCount.toString(16);
  }

  // One call, tried again on UNAVAILABLE (`retries` times); `retried`, if given, reads the
  // response of a call tried again (its first try's work may have been done: see cancel).
  async unary(method, request, timeoutMs = this.timeoutMs, retried = null) {
    for (let attempt = 1; ; attempt += 1) {
      try {
        const response = await new Promise((resolve, reject) => {
          this.stub[method](request, this.metadata(), { deadline: Date.now() + timeoutMs },
            (err, response) => (err ? reject(err) : resolve(response)));
        });
        return attempt > 1 && retried ? retried(response) : response;
      } catch (err) {
        if (err.code !== grpc.status.UNAVAILABLE || attempt > this.retries) throw new QdelayError(method, err);
        await sleep(backoff(attempt, this.backoffMs));
      }
    }
  }

  // A message as the wire wants it: exactly one of deliverAtMs / delayMs (default delay 0).
  message(subject, payload, opts = {}) {
    const m = {
      subject,
      payload: Buffer.isBuffer(payload) ? payload : Buffer.from(payload || ''),
      headers: opts.headers || {},
      message_id: opts.messageId || this.newId(),
    };
    if (opts.deliverAtMs !== undefined) m.deliver_at_ms = String(opts.deliverAtMs);
    else m.delay_ms = String(opts.delayMs || 0);
    return m;
  }

  // Schedule one message; resolves to its receipt {message_id, deliver_at_ms, sequence}.
  send(subject, payload, opts = {}) {
    const message = this.message(subject, payload, opts);
    if (this.batching === null) {
      return this.unary('Send', { message }).then((r) => withText(r.receipt));
    }
    if (this.sender === null) this.sender = new SendBatcher(this);
    return this.sender.send(message);
  }

  // A receipt object, its text (String(receipt)), or the message id alone.
  static ref(target) {
    return ref(target);
  }

  // Resolves to 'CANCELLED', 'ALREADY_CANCELLED', 'ALREADY_DELIVERED' or 'NOT_FOUND'. Tried
  // again after UNAVAILABLE, the first try may have written the tombstone: ALREADY_CANCELLED
  // then reads CANCELLED, as the Python clients answer (docs/api.md).
  async cancel(receipt) {
    return (await this.unary('Cancel', ref(receipt), this.timeoutMs, firstTry)).outcome;
  }

  // Cancel many in CancelBatch calls of up to batchSize targets (anything cancel takes);
  // resolves to one outcome per target, in order.
  async cancelMany(targets, opts = {}) {
    targets = Array.from(targets); // any iterable (a Set, a generator): .length of one was undefined, so nothing went
    const batchSize = opts.batchSize || 1000;
    const out = [];
    for (let i = 0; i < targets.length; i += batchSize) {
      const requests = targets.slice(i, i + batchSize).map(ref);
      const response = await this.unary('CancelBatch', { requests }, opts.timeoutMs, (b) => ({
        responses: b.responses.map(firstTry),
      }));
      out.push(...response.responses.map((r) => r.outcome));
    }
    return out;
  }

  // Move a pending message to a new due time (opts: deliverAtMs or delayMs); resolves to
  // {outcome: 'RESCHEDULED', receipt} (its new receipt) or {outcome, receipt: null}
  // ('ALREADY_DELIVERED', 'CANCELLED', 'NOT_FOUND').
  async reschedule(target, opts = {}) {
    const r = await this.unary('Reschedule', rescheduleRequest('Reschedule', target, opts), opts.timeoutMs);
    return rescheduled(r);
  }

  // Move many messages to one new time (opts as reschedule, plus batchSize, default 1000)
  // in RescheduleBatch calls; one answer per target, in order, as reschedule answers. A
  // batch with one bad target is refused whole (INVALID_ARGUMENT naming requests[i]).
  async rescheduleMany(targets, opts = {}) {
    targets = Array.from(targets); // any iterable, as cancelMany
    const batchSize = opts.batchSize || 1000;
    const out = [];
    for (let i = 0; i < targets.length; i += batchSize) {
      const requests = targets.slice(i, i + batchSize).map((t) => rescheduleRequest('RescheduleBatch', t, opts));
      const response = await this.unary('RescheduleBatch', { requests }, opts.timeoutMs);
      out.push(...response.responses.map(rescheduled));
    }
    return out;
  }

  async get(receipt) {
    return this.unary('Get', ref(receipt));
  }

  async stats() {
    return this.unary('Stats', {});
  }

  subscribe(subject, opts = {}) {
    const consumer = new Consumer(this, subject, opts.group || 'default', opts.maxInFlight || 1000);
    this.consumers.add(consumer);
    return consumer;
  }

  // Waits for queued sends to be answered, then closes the channel.
  async close() {
    for (const c of this.consumers) await c.close();
    if (this.sender !== null) await this.sender.close();
    this.stub.close();
  }
}

// send()'s batching: one SendStream, batches of whatever is queued (see the header).
class SendBatcher {
  constructor(client) {
    this.client = client;
    this.config = client.batching;
    this.waiting = []; // {message, resolve, reject}
    this.resend = []; // batches of a broken stream, in order
    this.spaceWaiters = [];
    this.call = null;
    this.unanswered = [];
    this.attempt = 0;
    this.timer = null;
    this.closing = null;
    this.batches = 0;
    this.streams = 0;
  }

  async send(message) {
    while (this.waiting.length >= this.config.maxQueued) {
      await new Promise((resolve) => this.spaceWaiters.push(resolve)); // backpressure
    }
    return new Promise((resolve, reject) => {
      this.waiting.push({ message, resolve, reject });
      this.pump();
    });
  }

  freeSpace() {
    while (this.spaceWaiters.length && this.waiting.length < this.config.maxQueued) this.spaceWaiters.shift()();
  }

  open() {
    this.streams += 1;
    const call = this.client.stub.SendStream(this.client.metadata());
    this.call = call;
    this.unanswered = [];
    call.on('data', (response) => {
      if (call !== this.call) return;
      const batch = this.unanswered.shift();
      this.attempt = 0;
      this.answer(batch, response);
      this.pump();
    });
    call.on('error', (err) => this.broken(call, err));
    call.on('end', () => this.broken(call, null));
  }

  // The stream ended or failed: decide what each unanswered batch becomes.
  broken(call, err) {
    if (call !== this.call) return;
    this.call = null;
    const unanswered = this.unanswered;
    this.unanswered = [];
    const code = err ? err.code : null;
    if (err === null || code === grpc.status.UNAVAILABLE || code === grpc.status.CANCELLED) {
      // the server went away or ended the stream: send the unanswered again, same ids
      this.resend = unanswered.concat(this.resend);
      if (unanswered.length) {
        this.attempt += 1;
        if (this.attempt > this.client.retries) {
          const error = new QdelayError('SendStream', err || { code: grpc.status.UNAVAILABLE, details: 'stream ended' });
          for (const b of this.resend) for (const e of b) e.reject(error);
          this.resend = [];
          this.attempt = 0;
        } else {
          setTimeout(() => this.pump(), backoff(this.attempt, this.client.backoffMs));
          return;
        }
      }
      this.pump();
      return;
    }
    const refused = unanswered.shift();
    this.resend = unanswered.concat(this.resend); // not written: they were behind it
    if (refused && code === grpc.status.INVALID_ARGUMENT && refused.length > 1) {
      this.resend = refused.map((e) => [e]).concat(this.resend); // so it refuses only its caller
    } else if (refused) {
      const error = new QdelayError('SendStream', refused.length === 1 && code === grpc.status.INVALID_ARGUMENT ? ownField(err) : err);
      for (const e of refused) e.reject(error);
    }
    this.pump();
  }

  answer(batch, response) {
    if (response.receipts.length) {
      batch.forEach((e, i) => e.resolve(withText(response.receipts[i])));
      return;
    }
    const first = BigInt(response.first_sequence);
    batch.forEach((e, i) => e.resolve(withText({
      message_id: e.message.message_id,
      deliver_at_ms: response.deliver_at_ms[i],
      sequence: String(first + BigInt(i)),
      shard: response.shard || '',
    })));
  }

  // Send what can be sent now: re-sent batches first, then a batch of the queue.
  pump() {
    if (this.timer !== null) return;
    while (this.unanswered.length < this.config.maxInFlight && (this.resend.length || this.waiting.length)) {
      if (this.call === null) this.open();
      let batch;
      if (this.resend.length) {
        batch = this.resend.shift();
      } else {
        if (this.unanswered.length && this.config.lingerMs > 0 && this.waiting.length < this.config.maxBatch) {
          // a batch is unanswered anyway: let this one gather for up to lingerMs
          this.timer = setTimeout(() => { this.timer = null; this.cut(); }, this.config.lingerMs);
          return;
        }
        batch = this.waiting.splice(0, this.config.maxBatch);
        this.freeSpace();
      }
      this.write(batch);
    }
    if (this.closing && !this.unanswered.length && !this.resend.length && !this.waiting.length) {
      if (this.call !== null) {
        const call = this.call;
        this.call = null;
        call.end();
      }
      this.closing();
    }
  }

  cut() {
    if (this.waiting.length && this.unanswered.length < this.config.maxInFlight) {
      if (this.call === null) this.open();
      const batch = this.waiting.splice(0, this.config.maxBatch);
      this.freeSpace();
      this.write(batch);
    }
    this.pump();
  }

  write(batch) {
    this.unanswered.push(batch);
    this.batches += 1;
    this.call.write({ messages: batch.map((e) => e.message), compact_receipts: true });
  }

  close() {
    return new Promise((resolve) => {
      this.closing = resolve;
      this.pump();
    });
  }
}

// One subscription that survives the server: emits 'batch' (an array of deliveries) and
// 'error' (a refusal other than the server going away); resubscribes with backoff.
class Consumer extends EventEmitter {
  constructor(client, subject, group, maxInFlight) {
    super();
    this.client = client;
    this.subject = subject;
    this.group = group;
    this.maxInFlight = maxInFlight;
    this.pendingAcks = [];
    this.reconnects = 0;
    this.closed = false;
    this.attempt = 0;
    this.call = null;
    this.ended = null;
    setImmediate(() => this.open());
  }

  open() {
    if (this.closed) return;
    const call = this.client.stub.Subscribe(this.client.metadata());
    this.call = call;
    call.on('data', (response) => {
      if (call !== this.call || this.closed) return; // after close: the server gives them to others
      this.attempt = 0;
      if (response.deliveries.length) this.emit('batch', response.deliveries);
    });
    const over = (err) => {
      if (call !== this.call) return;
      this.call = null;
      if (this.closed) {
        if (this.ended) this.ended();
        return;
      }
      if (err && ![grpc.status.UNAVAILABLE, grpc.status.CANCELLED].includes(err.code)) {
        this.emit('error', new QdelayError('Subscribe', err));
        return;
      }
      // the server went away or ended the stream: subscribe again, same subject/group/credit
      this.attempt += 1;
      this.reconnects += 1;
      this.emit('reconnect', this.attempt);
      setTimeout(() => this.open(), backoff(this.attempt, this.client.backoffMs));
    };
    call.on('error', over);
    call.on('end', () => over(null));
    call.on('status', () => {});
    const first = { subject: this.subject, group: this.group, max_in_flight: this.maxInFlight };
    if (this.pendingAcks.length) first.ack_ids = this.pendingAcks.splice(0);
    call.write(first);
  }

  // Acknowledge deliveries (objects or ack ids) in one request.
  ack(deliveries) {
    const ids = deliveries.map((d) => (typeof d === 'string' ? d : d.ack_id));
    if (!ids.length) return;
    if (this.call) this.call.write({ ack_ids: ids });
    else this.pendingAcks.push(...ids); // sent first on the next stream
  }

  addCredit(maxInFlight) {
    this.maxInFlight = maxInFlight;
    if (this.call) this.call.write({ max_in_flight: maxInFlight });
  }

  // Half-close: the server applies the acks written before, then ends the stream.
  close(timeoutMs = 5000) {
    if (this.closed) return Promise.resolve();
    this.closed = true;
    this.client.consumers.delete(this);
    const call = this.call;
    if (call === null) return Promise.resolve();
    return new Promise((resolve) => {
      const fallback = setTimeout(() => { call.cancel(); resolve(); }, timeoutMs);
      this.ended = () => { clearTimeout(fallback); resolve(); };
      call.end();
    });
  }
}

// A sharded cluster (servers started with --etcd/--cluster/--shard; docs/api.md, "Topology
// and shards"): the Topology read from any seed (never etcd), a message sent to shard
// names[crc32(message_id) % names.length] (names sorted, CRC-32/IEEE of the UTF-8 id: the
// same shard as every other client, and a retried id lands where it is deduplicated),
// FAILED_PRECONDITION / UNAVAILABLE retried with the same id on the shard's current master
// after reading the Topology again, cancel/get sent to the receipt's shard, and a consumer
// on every server of every shard (only masters dispatch). CANCELLED is retried too: it is
// what a node stopped in a rolling restart answers the calls it was serving, and only the
// server cancels here (the per-node clients have no retries of their own); same request
// and ids, so a retry is safe (the Python sharded clients do the same). Nothing is
// retried once the client is closed.
const RETRYABLE = ['UNAVAILABLE', 'FAILED_PRECONDITION', 'DEADLINE_EXCEEDED', 'CANCELLED'];

class ShardedClient {
  constructor(seeds, options = {}) {
    const given = typeof seeds === 'string' ? seeds.split(',').map((s) => s.trim()).filter(Boolean) : Array.from(seeds);
    if (given.length === 0) throw badTarget('a sharded client needs at least one seed address');
    this.seeds = given.map((seed) => checkTarget(seed, 'a seed address')); // each at once, as the Python clients
    this.options = options;
    this.failoverMs = options.failoverMs || 30000;
    this.clients = new Map();
    this.shards = new Map(); // name -> {name, master, slaves, epoch}
    this.names = []; // the shards' names, sorted: kept by refresh(), read for every message routed
    this.cluster = null;
    this.retries = 0;
    this.closed = false;
    this.idPrefix = `n${crypto.randomBytes(8).toString('hex')}-`;
    this.idCount = 0;
  }

  newId() {
    this.idCount += 1;
    return this.idPrefix + this.idCount.toString(16);
  }

  client(address) {
    if (!this.clients.has(address)) this.clients.set(address, new Client(address, { ...this.options, retries: 0 }));
    return this.clients.get(address);
  }

  addresses() {
    const out = new Set();
    for (const s of this.shards.values()) {
      if (s.master) out.add(s.master);
      for (const a of s.slaves) out.add(a);
    }
    return [...out];
  }

  // Read the Topology again (known servers first, then the seeds); per shard the highest
  // epoch seen wins (a stale server's older reading is ignored).
  async refresh() {
    let last = null;
    for (const address of new Set([...this.addresses(), ...this.seeds])) {
      try {
        const t = await this.client(address).unary('Topology', {}, 2000);
        this.cluster = t.cluster;
        for (const s of t.shards) {
          const have = this.shards.get(s.name);
          if (!have || BigInt(s.epoch) >= BigInt(have.epoch)) this.shards.set(s.name, s);
        }
        this.names = [...this.shards.keys()].sort();
        return this;
      } catch (err) {
        last = err;
      }
    }
    if (this.cluster === null) throw last;
    return this;
  }

  shardFor(messageId) {
    const names = this.names;
    if (!names.length) throw new Error('the cluster has no shard yet');
    return names[zlib.crc32(Buffer.from(messageId, 'utf8')) % names.length];
  }

  // The shard a receipt (object or text) names, else the message id's shard.
  shardOf(target) {
    const r = ref(target);
    if (r.receipt && r.receipt.shard && this.shards.has(r.receipt.shard)) return r.receipt.shard;
    return this.shardFor(r.receipt ? r.receipt.message_id : r.message_id);
  }

  async retry(shardOf, call) {
    if (this.cluster === null) await this.refresh();
    const deadline = Date.now() + this.failoverMs;
    for (let attempt = 1; ; attempt += 1) {
      const shard = this.shards.get(shardOf());
      let error = null;
      if (shard && shard.master) {
        try {
          return await call(this.client(shard.master));
        } catch (err) {
          if (this.closed || !RETRYABLE.includes(err.code)) throw err;
          error = err;
        }
      } else {
        error = new Error(`shard ${shardOf()} has no master (electing)`);
      }
      if (this.closed || Date.now() >= deadline) throw error;
      this.retries += 1;
      await sleep(backoff(attempt, 20));
      await this.refresh().catch(() => {});
    }
  }

  // Resolves to the receipt, which names its shard.
  send(subject, payload, opts = {}) {
    const messageId = opts.messageId || this.newId();
    return this.retry(() => this.shardFor(messageId), (c) => c.send(subject, payload, { ...opts, messageId }));
  }

  // Tried again on the shard's new master, a cancel reads ALREADY_CANCELLED as CANCELLED
  // (its first try may have cancelled it), as Client.cancel after UNAVAILABLE.
  cancel(receipt) {
    let tries = 0;
    return this.retry(() => this.shardOf(receipt), async (c) => {
      tries += 1;
      const outcome = await c.cancel(receipt);
      return tries > 1 ? firstTry({ outcome }).outcome : outcome;
    });
  }

  // Cancel many, grouped per shard (the shards' CancelBatch calls at the same time); one
  // outcome per target, in the caller's order.
  async cancelMany(targets, opts = {}) {
    return this.perShard(targets, (c, part, tries) => c.cancelMany(part, opts)
      .then((outcomes) => (tries > 1 ? outcomes.map((o) => firstTry({ outcome: o }).outcome) : outcomes)));
  }

  // Split targets by the shard that owns each, call `many(client, part, tries)` on every
  // shard's client at the same time (tries: 1, then 2... when retried on a new master), and
  // put the answers back in the caller's order.
  async perShard(targets, many) {
    targets = Array.from(targets); // any iterable (Set.forEach passes no index)
    if (this.cluster === null) await this.refresh();
    const byShard = new Map();
    targets.forEach((t, i) => {
      const shard = this.shardOf(t);
      if (!byShard.has(shard)) byShard.set(shard, []);
      byShard.get(shard).push(i);
    });
    const out = new Array(targets.length);
    await Promise.all([...byShard].map(async ([shard, idx]) => {
      let tries = 0;
      const got = await this.retry(() => shard, (c) => many(c, idx.map((i) => targets[i]), (tries += 1)));
      idx.forEach((i, k) => { out[i] = got[k]; });
    }));
    return out;
  }

  reschedule(target, opts = {}) {
    return this.retry(() => this.shardOf(target), (c) => c.reschedule(target, opts));
  }

  // Reschedule many, grouped per shard like cancelMany; answers in the caller's order.
  async rescheduleMany(targets, opts = {}) {
    return this.perShard(targets, (c, part) => c.rescheduleMany(part, opts));
  }

  get(receipt) {
    return this.retry(() => this.shardOf(receipt), (c) => c.get(receipt));
  }

  // One resubscribing Consumer per server; 'batch' events from all of them, each delivery
  // acked on the stream it came from. Every server numbers its own deliveries, so two
  // shards hand out the same ack ids: each delivery's ack_id is given its stream's tag
  // ('<tag>|<ack id>', as the Python sharded consumers do) and an ack goes to that stream.
  subscribe(subject, opts = {}) {
    const fan = new EventEmitter();
    const streams = new Map(); // tag -> consumer
    const consumers = new Map();
    let tags = 0;
    const add = () => {
      for (const address of this.addresses()) {
        if (consumers.has(address)) continue;
        const c = this.client(address).subscribe(subject, opts);
        const tag = String(++tags);
        streams.set(tag, c);
        consumers.set(address, c);
        c.on('batch', (deliveries) => {
          for (const d of deliveries) d.ack_id = `${tag}|${d.ack_id}`;
          fan.emit('batch', deliveries);
        });
        c.on('error', (err) => {
          // a slave refuses a subscription while the group does not exist there yet: try
          // again at the next Topology read (it may be master after a failover)
          consumers.delete(address);
          streams.delete(tag);
          if (err.code !== 'FAILED_PRECONDITION') fan.emit('error', err);
        });
      }
    };
    add();
    const timer = setInterval(() => this.refresh().then(add, () => {}), 2000);
    fan.ack = (deliveries) => {
      const by = new Map();
      for (const d of deliveries) {
        const id = typeof d === 'string' ? d : d.ack_id;
        const cut = id.indexOf('|');
        if (cut < 0) throw new Error(`not an ack id of this sharded consumer: ${id}`);
        const c = streams.get(id.slice(0, cut));
        if (c) by.set(c, [...(by.get(c) || []), id.slice(cut + 1)]);
      }
      for (const [c, ids] of by) c.ack(ids);
    };
    fan.close = async () => {
      clearInterval(timer);
      for (const c of consumers.values()) await c.close();
    };
    return fan;
  }

  async close() {
    this.closed = true;
    for (const c of this.clients.values()) await c.close();
  }
}

module.exports = { Client, Consumer, QdelayError, ShardedClient, checkTarget, parseReceipt, receiptString };
