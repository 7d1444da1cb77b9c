"""``flowerbed bench`` and every evaluation harness: the benchmark's own home.

- :mod:`.cli`: the ``flowerbed bench`` subcommand (plan, progress, report);
- :mod:`.suite`: every fleet x strategy x seed on the in-process engine;
- :mod:`.machinery`: what the machinery costs (aggregation, engines, client
  metering, gateway memory, cluster selection);
- :mod:`.aggregation`: one aggregation measurement in a fresh process;
- :mod:`.selection_eval`: ClusterSelection's choices against the truth on
  simulated fleets;
- :mod:`.report`: results.json, the plots and BENCHMARKS.md.

The benchmark may use everything (the simulator, the strategies, the clients);
nothing outside it imports it.
"""
