-- wrk script for the sidecar's P/D connector benchmark (docs/benchmarks.md § sidecar P/D
-- connectors): non-streaming completions naming a prefiller.
-- Env: PD_PREFILLER (ip:port, required), PD_MAX_TOKENS (default 4), PD_PROMPT_BYTES (default 256).
local prefiller = os.getenv("PD_PREFILLER")
local max_tokens = tonumber(os.getenv("PD_MAX_TOKENS") or "4")
local prompt_bytes = tonumber(os.getenv("PD_PROMPT_BYTES") or "256")
local counter = 0

request = function()
  counter = counter + 1
  -- A distinct prompt per request, so every prefill computes and every decode pulls its blocks.
  local p = string.format("user-%08d ", counter)
  p = string.rep(p, math.max(1, math.floor(prompt_bytes / #p)))
  local body = string.format(
    '{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true}', p, max_tokens)
  return wrk.format("POST", "/v1/completions",
    {["Content-Type"] = "application/json", ["x-prefiller-host-port"] = prefiller}, body)
end

done = function(summary, latency, requests)
  io.write(string.format("non-200 responses: %d\n", summary.errors.status))
end
