"""Locust side of mtp-canary: streaming LLM traffic and its per-request measurement.

Runnable alone (`locust -f loadtests/locustfile.py --host URL`), and driven from Ray
through `loadtests.swarm.Swarm`, which starts Locust as child processes. This package
knows nothing of Ray, the cluster or the gates, and this file imports nothing, so that
`import loadtests.swarm` in a Ray process never pulls in Locust or gevent.

  records        RequestRecord: one request as the client saw it; JSONL read/write
  options        TrafficOptions: the --mtp-* flags as one typed object
  datasets       seeded prompt sources (synthetic, shared-prefix groups, gsm8k, user JSONL)
  arrivals       open-loop schedules (constant, Poisson, gamma), partitioned over workers
  profiles       stepped and ramped load (levels over time), for both loops
  shapes         the Locust load shape that plays a profile (imports Locust)
  health         generator health: worker CPU, send lag, "the generator limited the load"
  traffic        one process's share of the traffic (which prompt, which arm, when)
  sse            server-sent events from timestamped reads
  openai_stream  one streaming request to an OpenAI-compatible server -> RequestRecord
  collection     worker -> master record shipping and its completeness summary
  locustfile     the Locust user and event wiring
  swarm          SwarmSpec / Swarm / SwarmResult: master + workers as processes
                 (workers local, or under Ray actors via cluster.distributed_load)
"""
