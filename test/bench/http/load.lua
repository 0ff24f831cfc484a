-- wrk script of `test/run bench http`: POSTs with an Idempotency-Key.
--   wrk ... -s load.lua URL -- MODE PATH PREFIX [KEYS]
-- MODE new: every request a key never sent before (PREFIX, the thread and a
-- counter); replay: keys PREFIX-0 .. PREFIX-(KEYS-1) in turn, which the
-- bench completed beforehand.  Every request has the same body, so a
-- replay's fingerprint matches.  done() prints one line for the bench:
--   RESULT requests duration_us p50_us p99_us non2xx socket_errors

local threads = {}
local counter = 0

function setup(thread)
	thread:set("tid", #threads)
	table.insert(threads, thread)
end

function init(args)
	mode, path, prefix, keys = args[1], args[2], args[3], tonumber(args[4] or "1")
	body = '{"customer": "cus_bench", "amount": 1000, "currency": "EUR"}'
	headers = { ["Content-Type"] = "application/json" }
end

function request()
	counter = counter + 1
	if mode == "new" then
		headers["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. counter
	else
		headers["Idempotency-Key"] = prefix .. "-" .. (counter % keys)
	end
	return wrk.format("POST", path, headers, body)
end

function done(summary, latency, requests)
	local e = summary.errors
	io.write(string.format("RESULT %d %d %d %d %d %d\n", summary.requests, summary.duration,
		latency:percentile(50), latency:percentile(99), e.status, e.connect + e.read + e.write + e.timeout))
end
