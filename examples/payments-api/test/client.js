// An HTTP client for the tests (and for test/bench/http): POST a JSON body
// with an Idempotency-Key over node:http, so that a caller can choose the
// connection (an http.Agent with keepAlive and maxSockets 1 is one open
// connection).
//
// postJson(url, key, body, {agent, timeoutMs}) resolves to
//   {status, text, replayed}     the response (replayed: Idempotent-Replayed)
//   {status: 'gave up'}          no response within timeoutMs (the request is
//                                dropped, as a client that times out does)
//   {status: 'no answer'}        the connection failed or was closed
import http from 'node:http';

export function postJson(url, key, body, { agent, timeoutMs = 15000 } = {}) {
	return new Promise((resolve) => {
		const data = JSON.stringify(body);
		const req = http.request(url, {
			method: 'POST',
			agent,
			headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data), 'idempotency-key': key },
		}, (res) => {
			let text = '';
			res.on('data', (d) => { text += d; });
			res.on('end', () => resolve({ status: res.statusCode, text, replayed: res.headers['idempotent-replayed'] === 'true' }));
		});
		const timer = setTimeout(() => {
			req.destroy();
			resolve({ status: 'gave up' });
		}, timeoutMs);
		req.on('error', () => resolve({ status: 'no answer' }));
		req.on('close', () => clearTimeout(timer));
		req.end(data);
	});
}
