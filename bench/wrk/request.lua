-- One fixed request, again and again: FERRY_BENCH_METHOD (GET), FERRY_BENCH_PATH,
-- FERRY_BENCH_BODY (JSON, optional), FERRY_BENCH_TOKEN (optional). A 2xx
-- response counts as a job done (a submission, or a read).
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "common.lua")

local prepared

function init(args)
   local body = os.getenv("FERRY_BENCH_BODY")
   if body == "" then
      body = nil
   end
   prepared = wrk.format(env("FERRY_BENCH_METHOD", "GET"), env("FERRY_BENCH_PATH"),
                         auth_headers(body ~= nil), body)
end

function request()
   return prepared
end

function response(status, headers, body)
   count_status(status)
   if status >= 200 and status < 300 then
      completed = completed + 1
   end
end
