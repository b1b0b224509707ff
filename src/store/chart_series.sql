-- The dashboard's charts: per consumer and time bucket, over the stats samples of a window.
-- $1 the window's end (the database's now, read first so the caller can draw the same span),
-- $2 the window in ms, $3 the bucket width in seconds, $4 most samples read, $5 one consumer
-- or NULL for all.
--
-- Counts in a sample are the increments since its instance's previous sample, about
-- `interval_ms` earlier. So an instance's throughput in a bucket is its processed count over
-- the intervals its samples there cover (a bucket the instance sampled only partly, or one
-- narrower than its interval, still gets a rate, not a fraction or a spike), and the
-- instances' throughputs add up. Backlog and oldest due age are database-wide gauges each
-- instance reads alike: the worst in the bucket is taken, never a sum.
--
-- Expected plan: `Index Scan Backward` of `outbox_stats_samples_at` under the `Limit`,
-- stopping at the window's start or at $4 samples, whichever comes first (the newest kept).
WITH recent AS (
    SELECT instance, sampled_at, interval_ms, sample
    FROM actix_outbox.outbox_stats_samples
    WHERE sampled_at > $1 - $2 * interval '1 millisecond' AND sampled_at <= $1
    ORDER BY sampled_at DESC
    LIMIT $4
),
per_instance AS (
    SELECT c->>'consumer' AS consumer,
           floor(extract(epoch FROM r.sampled_at) / $3)::int8 * $3 AS bucket,
           r.instance,
           sum(coalesce((c->>'processed')::int8, 0))::int8 AS processed,
           sum(r.interval_ms)::float8 AS covered_ms,
           max(coalesce((c->>'backlog')::int8, 0))::int8 AS backlog,
           max(coalesce((c->>'oldest_due_age_seconds')::float8, 0))::float8 AS oldest_due_age
    FROM recent r, jsonb_array_elements(r.sample->'consumers') c
    WHERE $5::text IS NULL OR c->>'consumer' = $5::text
    GROUP BY 1, 2, 3
)
SELECT consumer,
       to_timestamp(bucket) AS at,
       sum(processed)::int8 AS processed,
       sum(processed * 1000.0 / covered_ms)::float8 AS per_second,
       max(backlog)::int8 AS backlog,
       max(oldest_due_age)::float8 AS oldest_due_age,
       count(*) AS instances,
       (SELECT count(*) FROM recent) AS samples
FROM per_instance
GROUP BY consumer, bucket
ORDER BY consumer, bucket
