// The addresses the Node module refuses when a client is made (qdelay.js checkTarget), run by
// the test suite (tests/test_node_example.py) beside the Python clients' check: no server.
//
//   node check_targets.js '["http://127.0.0.1:7600", "127.0.0.1:7600", ...]'
//       one JSON line per address: {"target", "client", "sharded", "message"}, "client" and
//       "sharded" the details of the refusal by new Client / new ShardedClient (null: made),
//       "message" the first one's whole error message.
'use strict';

const { Client, ShardedClient } = require('./qdelay');

function attempt(make) {
  try {
    const made = make();
    made.close();
    return [null, null];
  } catch (err) {
    if (err.code !== 'INVALID_ARGUMENT') throw err;
    return [err.details, err.message];
  }
}

for (const target of JSON.parse(process.argv[2])) {
  const [client, message] = attempt(() => new Client(target));
  const [sharded] = attempt(() => new ShardedClient(target));
  console.log(JSON.stringify({ target, client, sharded, message }));
}
