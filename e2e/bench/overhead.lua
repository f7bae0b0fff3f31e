-- wrk script for the Envoy+EPP overhead benchmark (e2e/bench/envoy_overhead.sh).
-- Env: BODY_BYTES (approximate request size), HISTORY (1: every request shares one large
-- conversation history and differs only in its last turn, the multi-turn case; 0: the whole
-- prompt differs per request); TEXT (random, the default: words drawn by a pseudo-random
-- generator seeded per request, so no chunk of one prompt's text recurs in another and "new"
-- prompts are really cold for the EPP's tokenization cache; periodic: the earlier generator, a
-- 30-word cycle whose phase varies, so after a few requests every chunk past the first is
-- already cached); RUN (a number unique to this wrk invocation, mixed into every request's id
-- and text seed, so a measured run never replays its warm-up's prompts).
local body_bytes = tonumber(os.getenv("BODY_BYTES") or "8192")
local shared_history = os.getenv("HISTORY") == "1"
local periodic = os.getenv("TEXT") == "periodic"
local run = tonumber(os.getenv("RUN") or "0")
local words = {"the","cache","request","model","token","prefix","server","gateway","route","block",
  "memory","latency","cluster","policy","engine","decode","prefill","batch","queue","stream",
  "answer","question","data","value","index","node","service","context","window","summary"}
local counter = 0
local thread_id = 0

setup = function(thread)
  thread_id = thread_id + 1
  thread:set("tid", thread_id)
end

-- Park-Miller generator: products stay below 2^53, exact in Lua numbers.
local function next_state(x)
  return (x * 16807) % 2147483647
end

local function text(n, seed)
  local out, i, len = {}, 0, 0
  local x = (seed * 7919 + (tid or 0) * 104729) % 2147483646 + 1
  while len < n do
    i = i + 1
    local w
    if periodic then
      w = words[((seed * 31 + i * 7) % #words) + 1]
    else
      x = next_state(x)
      w = words[(x % #words) + 1]
    end
    out[i] = w
    len = len + #w + 1
  end
  return table.concat(out, " ")
end

local history = nil

request = function()
  counter = counter + 1
  local id = string.format("w%d-t%d-r%d", run, tid or 0, counter)
  -- A block of 10^7 seeds per run; seed * 7919 stays far below 2^53, exact in Lua numbers.
  local seed = run * 10000000 + counter
  local messages
  if shared_history then
    if history == nil then
      history = string.format('{"role":"system","content":"%s"},{"role":"user","content":"%s"},{"role":"assistant","content":"%s"}',
        text(256, 1), text(body_bytes - 1024, 2), text(256, 3))
    end
    messages = string.format('%s,{"role":"user","content":"question %s: %s"}', history, id, text(400, seed))
  else
    messages = string.format('{"role":"user","content":"request %s: %s"}', id, text(body_bytes - 128, seed))
  end
  local body = string.format('{"model":"m","messages":[%s],"max_tokens":1,"ignore_eos":true}', messages)
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, body)
end

done = function(summary, latency, requests)
  io.write(string.format("RESULT requests=%d non2xx=%d errors=%d p50_us=%d p99_us=%d mean_us=%d\n",
    summary.requests, summary.errors.status, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
