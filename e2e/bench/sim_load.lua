-- wrk script for the kvgate-sim throughput benchmark (docs/benchmarks.md § simulator).
-- Env: SIM_MAX_TOKENS (default 1), SIM_STREAM (0/1), SIM_PROMPT_BYTES (default 64).
local max_tokens = tonumber(os.getenv("SIM_MAX_TOKENS") or "1")
local stream = os.getenv("SIM_STREAM") == "1"
local prompt_bytes = tonumber(os.getenv("SIM_PROMPT_BYTES") or "64")
local counter = 0

request = function()
  counter = counter + 1
  -- A distinct prompt per request so no two are identical (a few shared prefixes via modulo).
  local p = string.format("user-%06d ", counter % 997)
  p = string.rep(p, math.max(1, math.floor(prompt_bytes / #p)))
  local body = string.format(
    '{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":%s}',
    p, max_tokens, stream and "true" or "false")
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end

local errors = 0
response = function(status, headers, body)
  if status ~= 200 then errors = errors + 1 end
end

done = function(summary, latency, requests)
  io.write(string.format("non-200 responses: %d\n", summary.errors.status))
end
