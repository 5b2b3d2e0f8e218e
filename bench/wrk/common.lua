-- Shared by bench/wrk/*.lua (run by bench/api.py): counts responses by status,
-- and prints one machine-readable line when wrk is done:
--   FERRY_WRK {"requests":..,"statuses":{"202":..},"completed":..,"latency_us":{..},..}
-- Each wrk thread has a Lua state of its own; done() runs in the main one and
-- collects what the threads counted through thread:get().

statuses = {}     -- status code (as a string) -> responses, in this thread
completed = 0     -- what the script counts as a job done (set by the script)
job_ms = {}       -- server-side accepted -> finished of each job seen terminal

local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

function count_status(status)
   local key = tostring(status)
   statuses[key] = (statuses[key] or 0) + 1
end

function env(name, default)
   local value = os.getenv(name)
   if value == nil or value == "" then
      if default == nil then
         error("bench/wrk: " .. name .. " is not set")
      end
      return default
   end
   return value
end

function auth_headers(with_body)
   local headers = {}
   local token = os.getenv("FERRY_BENCH_TOKEN")
   if token ~= nil and token ~= "" then
      headers["Authorization"] = "Bearer " .. token
   end
   if with_body then
      headers["Content-Type"] = "application/json"
   end
   return headers
end

-- For the scripts that submit jobs and long-poll them (longpoll.lua, clients.lua): the ids
-- of jobs submitted and not yet seen terminal wait in a FIFO, the thread's own (wrk's
-- request() is not told which connection it is for).
local TERMINAL = {succeeded = true, failed = true, expired = true, cancelled = true}
local pending, head, tail = {}, 1, 0

-- The GET that long-polls the oldest job not yet seen terminal; nil when none is waiting.
function next_poll(wait, headers)
   if head > tail then
      return nil
   end
   local id = pending[head]
   pending[head] = nil
   head = head + 1
   return wrk.format("GET", "/v1/jobs/" .. id .. "?wait=" .. wait, headers)
end

-- Counts the response to a submission or a poll. A terminal answer counts as a job done
-- (its timings.total_ms kept) and its status is returned; a job accepted, or not terminal
-- when the long-poll's wait ran out, is queued to be polled (again).
function job_response(status, body)
   count_status(status)
   if status ~= 200 and status ~= 202 then
      return nil
   end
   -- The job's own id comes first in its resource; the batch's id comes later.
   local id = body:match('"id":"([^"]+)"')
   local state = body:match('"status":"(%a+)"')
   if id == nil then
      return nil
   end
   if status == 200 and TERMINAL[state] then
      completed = completed + 1
      local total = body:match('"total_ms":([%d%.eE+-]+)')
      if total ~= nil then
         table.insert(job_ms, tonumber(total))
      end
      return state
   end
   tail = tail + 1
   pending[tail] = id
   return nil
end

local function json_object(map)
   local parts = {}
   for key, value in pairs(map) do
      table.insert(parts, string.format("%q:%s", tostring(key), tostring(value)))
   end
   return "{" .. table.concat(parts, ",") .. "}"
end

local function quantile(sorted, q)
   if #sorted == 0 then
      return "null"
   end
   local index = math.min(#sorted, math.floor(q * #sorted) + 1)
   return string.format("%.3f", sorted[index])
end

function done(summary, latency, requests)
   local merged, total_completed, all_ms = {}, 0, {}
   for _, thread in ipairs(threads) do
      for key, value in pairs(thread:get("statuses") or {}) do
         merged[key] = (merged[key] or 0) + value
      end
      total_completed = total_completed + (thread:get("completed") or 0)
      for _, value in ipairs(thread:get("job_ms") or {}) do
         table.insert(all_ms, value)
      end
   end
   table.sort(all_ms)
   local e = summary.errors
   local fields = {
      '"duration_us":' .. summary.duration,
      '"requests":' .. summary.requests,
      '"bytes":' .. summary.bytes,
      '"completed":' .. total_completed,
      '"statuses":' .. json_object(merged),
      '"errors":' .. json_object({connect = e.connect, read = e.read, write = e.write,
                                  status = e.status, timeout = e.timeout}),
      '"latency_us":' .. json_object({p50 = latency:percentile(50), p90 = latency:percentile(90),
                                      p99 = latency:percentile(99), max = latency.max,
                                      mean = latency.mean}),
      '"job_ms":' .. json_object({count = #all_ms, p50 = quantile(all_ms, 0.50),
                                  p99 = quantile(all_ms, 0.99)}),
   }
   io.write("FERRY_WRK {" .. table.concat(fields, ",") .. "}\n")
end
