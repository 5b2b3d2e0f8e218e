-- Closed-loop clients with bodies of their own (run by bench/clients.py): each
-- connection submits POST /v1/jobs with the next body of FERRY_BENCH_BODIES (a
-- file of JSON bodies, one a line, read at init; the first is line
-- FERRY_BENCH_OFFSET + 1, default 0, and the list wraps round), then long-polls
-- GET /v1/jobs/{id}?wait=FERRY_BENCH_WAIT (default 30) until the job is
-- terminal, then submits the next. A terminal answer counts as a job done; its
-- timings.total_ms is kept (as bench/wrk/longpoll.lua does) and so is its
-- batch.size. Besides common.lua's FERRY_WRK line, done() prints
--   FERRY_CLIENTS {"bodies":..,"submitted":..,"states":{"succeeded":..,..},
--                  "batch_sizes":{"<size>":<jobs>,..},
--                  "job_ms":[<timings.total_ms of each job seen terminal>,..]}
--
-- The ids of jobs submitted and not yet seen terminal wait in common.lua's FIFO,
-- as for longpoll.lua; since a connection sends its next request right after its
-- response, each connection alternates one submission and the polls of one
-- job: FERRY_BENCH_CONNECTIONS closed-loop clients, one job each in hand.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "common.lua")

local bodies = {}
local submit_headers, get_headers, wait
local next_body = 1

body_count = 0    -- bodies read at init
submitted = 0     -- jobs this thread submitted (2xx or not)
batch_sizes = {}  -- batch.size (as a string) -> jobs seen terminal in a batch of that size
states = {}       -- terminal status -> jobs seen in it

function init(args)
   local path = env("FERRY_BENCH_BODIES")
   local file = assert(io.open(path, "r"), "bench/wrk/clients.lua: cannot open " .. path)
   for line in file:lines() do
      if line ~= "" then
         table.insert(bodies, line)
      end
   end
   file:close()
   if #bodies == 0 then
      error("bench/wrk/clients.lua: no bodies in " .. path)
   end
   body_count = #bodies
   next_body = (tonumber(env("FERRY_BENCH_OFFSET", "0")) % #bodies) + 1
   submit_headers = auth_headers(true)
   get_headers = auth_headers(false)
   wait = env("FERRY_BENCH_WAIT", "30")
end

function request()
   local poll = next_poll(wait, get_headers)
   if poll ~= nil then
      return poll
   end
   local body = bodies[next_body]
   next_body = next_body % #bodies + 1
   submitted = submitted + 1
   return wrk.format("POST", "/v1/jobs", submit_headers, body)
end

function response(status, headers, body)
   local state = job_response(status, body)
   if state ~= nil then
      states[state] = (states[state] or 0) + 1
      local batch = body:match('"batch":(%b{})')
      local size = batch and batch:match('"size":(%d+)') or "none"
      batch_sizes[size] = (batch_sizes[size] or 0) + 1
   end
end

local threads = {}
local common_setup, common_done = setup, done

function setup(thread)
   table.insert(threads, thread)
   common_setup(thread)
end

function done(summary, latency, requests)
   common_done(summary, latency, requests)
   local sizes, total_submitted, parts, count, times = {}, 0, {}, 0, {}
   local by_state, state_parts = {}, {}
   for _, thread in ipairs(threads) do
      count = math.max(count, thread:get("body_count") or 0)
      for _, value in ipairs(thread:get("job_ms") or {}) do
         table.insert(times, string.format("%.3f", value))
      end
      total_submitted = total_submitted + (thread:get("submitted") or 0)
      for key, value in pairs(thread:get("batch_sizes") or {}) do
         sizes[key] = (sizes[key] or 0) + value
      end
      for key, value in pairs(thread:get("states") or {}) do
         by_state[key] = (by_state[key] or 0) + value
      end
   end
   for key, value in pairs(by_state) do
      table.insert(state_parts, string.format('"%s":%d', key, value))
   end
   for key, value in pairs(sizes) do
      table.insert(parts, string.format('"%s":%d', key, value))
   end
   io.write(string.format(
      'FERRY_CLIENTS {"bodies":%d,"submitted":%d,"states":{%s},"batch_sizes":{%s},' ..
      '"job_ms":[%s]}\n',
      count, total_submitted, table.concat(state_parts, ","), table.concat(parts, ","),
      table.concat(times, ",")))
end
