# For tools/repro/lws-self-steal.sh: at worker 0's lws_select_victim, the state the race makes
set pagination off
set breakpoint pending on
handle SIGUSR1 SIGUSR2 SIGPIPE nostop noprint
break lws_select_victim
commands
silent
if workerid == 0 && deny0 == 1
  set var ws->per_worker[0].busy = 1
  set var _starpu_worker_parallel_blocks = 1
  set var deny0 = 0
  printf "forced: worker 0 busy, parallel-blocks flag set\n"
end
continue
end
run
thread apply all bt 8
kill
quit
