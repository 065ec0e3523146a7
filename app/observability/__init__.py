"""What a replica observes about its requests, one way round: records <- metrics, records <- tracing, and replica
over both.

- records.py: RequestContext (what the app knows of a request), RequestTally and RequestRecord (what the
  request did, made from the engine's final output);
- metrics.py: the replica's Prometheus registry (per-request counters and histograms, engine gauges at scrape);
- tracing.py: one SERVER span per request with queue/prefill/decode children, and the trace-context middleware;
- replica.py: ReplicaObservability, which sets both up for one replica and takes each finished request's record.
"""
