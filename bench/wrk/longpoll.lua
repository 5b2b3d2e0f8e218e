-- Submit, then long-poll until the job is terminal: POST FERRY_BENCH_BODY to
-- /v1/jobs, then GET /v1/jobs/{id}?wait=FERRY_BENCH_WAIT (default 10) until
-- its status is terminal, then submit the next one. A terminal answer counts
-- as a job done; its timings.total_ms (accepted -> finished) is kept.
--
-- wrk's request() is not told which connection it is for, so the state is
-- the thread's, not each connection's: the ids of jobs submitted and not yet
-- seen terminal wait in a FIFO, and a connection that is free to send polls
-- the oldest of them, or submits a new job when there is none. As each
-- connection sends its next request right after its response, this is each
-- connection alternating submit and long-poll, with the polls possibly
-- handed between connections (which HTTP/1.1 keep-alive cannot tell apart);
-- at most one job per connection is ever in hand.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "common.lua")

local submit, get_headers, wait

function init(args)
   submit = wrk.format("POST", "/v1/jobs", auth_headers(true), env("FERRY_BENCH_BODY"))
   get_headers = auth_headers(false)
   wait = env("FERRY_BENCH_WAIT", "10")
end

function request()
   return next_poll(wait, get_headers) or submit
end

function response(status, headers, body)
   job_response(status, body)
end
