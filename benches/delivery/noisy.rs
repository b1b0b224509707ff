//! The `noisy-neighbour` scenario: a healthy consumer's drain beside a failing, a quiet and a
//! blocking one.

use super::*;

/// The healthy consumer of `noisy-neighbour`; its neighbour's name.
pub(super) const HEALTHY: &str = "effects";
pub(super) const NEIGHBOUR: &str = "failing";

/// The noisy neighbour: every call fails, to be retried; it writes nothing.
pub(super) struct Failing;

/// A quiet neighbour: every call succeeds at once; it writes nothing. Beside it the healthy
/// consumer pays for a second subscription (the publisher fans each event out twice) and
/// nothing else, which is what separates that cost from the cost of failing.
pub(super) struct Quiet;

impl Actor for Quiet {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Quiet {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, _: Delivery, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async { Ok(()) })
    }
}

impl Handler<DeliveryBatch> for Quiet {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, _: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async { Ok(()) })
    }
}

/// Who runs beside the healthy consumer of `noisy-neighbour`.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Neighbour {
    None,
    Quiet,
    Failing,
    Blocking,
}

/// A neighbour whose handler blocks its thread for 200 ms per event (a synchronous client,
/// a parser), then succeeds; it writes nothing.
pub(super) struct Blocking;

/// How long [`Blocking`] blocks its thread per event.
pub(super) const BLOCK: Duration = Duration::from_millis(200);

impl Actor for Blocking {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Blocking {
    type Result = Result<(), HandlerError>;

    fn handle(&mut self, _: Delivery, _: &mut Context<Self>) -> Self::Result {
        std::thread::sleep(BLOCK);
        Ok(())
    }
}

impl Handler<DeliveryBatch> for Blocking {
    type Result = Result<(), HandlerError>;

    fn handle(&mut self, b: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        std::thread::sleep(BLOCK * b.deliveries().len() as u32);
        Ok(())
    }
}

impl Actor for Failing {
    type Context = Context<Self>;
}

impl Handler<Delivery> for Failing {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, _: Delivery, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async { Err(HandlerError::retry("noisy neighbour: always fails")) })
    }
}

impl Handler<DeliveryBatch> for Failing {
    type Result = ResponseFuture<Result<(), HandlerError>>;

    fn handle(&mut self, _: DeliveryBatch, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async { Err(HandlerError::retry("noisy neighbour: always fails")) })
    }
}

/// A runtime on `pool` with the healthy consumer and, with `neighbour`, the failing one, both
/// of the handler shape of `--handler`.
pub(super) async fn start_noisy_runtime(
    ctx: &Ctx,
    pool: PgPool,
    track: &Arc<Track>,
    neighbour: Neighbour,
) -> Res<OutboxRuntime> {
    let mut b = OutboxRuntime::builder(pool).config(ctx.opts.runtime_config());
    let (track, name): (Arc<Track>, Arc<str>) = (track.clone(), Arc::from(HEALTHY));
    let sink = move || Sink {
        track: track.clone(),
        index: 0,
        name: name.clone(),
    };
    b = with_handler(
        b,
        ctx.opts.batch_handler,
        ctx.opts.consumer_config(HEALTHY),
        sink,
    );
    // Short and many: it fails again every 200 ms for the whole drain, never dead-letters.
    let cfg = ctx
        .opts
        .consumer_config(NEIGHBOUR)
        .retry(RetryPolicy::fixed(1000, Duration::from_millis(200)));
    let batch = ctx.opts.batch_handler;
    b = match neighbour {
        Neighbour::None => b,
        Neighbour::Quiet => with_handler(b, batch, cfg, || Quiet),
        Neighbour::Failing => with_handler(b, batch, cfg, || Failing),
        Neighbour::Blocking => with_handler(b, batch, cfg, || Blocking),
    };
    Ok(b.start().await?)
}

/// One drain of a fresh backlog by the healthy consumer on `runtimes` runtimes, each with the
/// failing neighbour beside it if `neighbour`.
pub(super) struct NoisyDrain {
    /// From the runtimes' start to the healthy consumer's "done"; `None` past the limit.
    seconds: Option<f64>,
    /// The neighbour's attempts by then (`sum(attempt_count)` over its inbox rows).
    neighbour_attempts: f64,
    /// Its rows dead-lettered by then: 0, or the neighbour stopped failing early.
    neighbour_dead: f64,
    /// Problems with the healthy consumer's effects, if any.
    check: Option<String>,
}

pub(super) async fn noisy_drain(
    ctx: &Ctx,
    runtimes: usize,
    neighbour: Neighbour,
) -> Res<NoisyDrain> {
    let o = &ctx.opts;
    let events = o.events;
    let mut mon = ctx.pool.get().await?;
    mon.batch_execute(RESET).await?;
    let track = Track::new(events, 1);
    let produce_args = Produce {
        events,
        per_tx: o.batch_per_tx,
        rate: None,
        one_statement: o.one_statement,
        payload_bytes: o.payload_bytes,
    };
    let (url, t) = (ctx.url.clone(), track.clone());
    on_own_thread(move || produce(url, t, produce_args, None))
        .await
        .map_err(|e| format!("producer: {e}"))?;
    // Each runtime its own pool, as two instances would have; opened before the clock starts.
    let mut pools = Vec::with_capacity(runtimes);
    for _ in 0..runtimes {
        pools.push(actix_outbox::connect(&ctx.url, o.pool_size()).await?);
    }
    let from = track.now();
    let mut started = Vec::with_capacity(runtimes);
    for pool in pools {
        match start_noisy_runtime(ctx, pool, &track, neighbour).await {
            Ok(rt) => started.push(rt),
            Err(e) => {
                futures_util::future::join_all(started.iter().map(|rt| rt.shutdown())).await;
                return Err(e);
            }
        }
    }
    let names = [HEALTHY.to_owned()];
    let done = wait_done(&mut mon, &track, &names, Instant::now() + SCENARIO_LIMIT).await;
    let neighbour_attempts = number(
        &mut mon,
        &format!(
            "SELECT coalesce(sum(attempt_count), 0)::float8 AS n FROM actix_outbox.inbox_events \
             WHERE consumer = '{NEIGHBOUR}'"
        ),
    )
    .await;
    let neighbour_dead = number(
        &mut mon,
        &format!(
            "SELECT count(*)::float8 AS n FROM actix_outbox.inbox_events \
             WHERE consumer = '{NEIGHBOUR}' AND status = 'DEAD_LETTER'"
        ),
    )
    .await;
    futures_util::future::join_all(started.iter().map(|rt| rt.shutdown())).await;
    let done = done?;
    let effects = number(&mut mon, "SELECT count(*)::float8 AS n FROM bench_effects").await?;
    let dup_effects = number(
        &mut mon,
        "SELECT (count(*) - count(DISTINCT event_id))::float8 AS n FROM bench_effects",
    )
    .await?;
    let (_, missing) = track.latencies();
    let duplicates = track.duplicates();
    let check = (effects != events as f64 || dup_effects > 0.0 || missing > 0 || duplicates > 0)
        .then(|| {
            format!(
                "CHECK effects {effects}/{events} dup effects {dup_effects} missing starts \
                 {missing} redeliveries {duplicates}"
            )
        });
    Ok(NoisyDrain {
        seconds: done[0].map(|d| (d - from) as f64 / 1e9),
        neighbour_attempts: neighbour_attempts?,
        neighbour_dead: neighbour_dead?,
        check,
    })
}

/// `noisy-neighbour`: the healthy consumer's drain alone, beside a quiet neighbour and beside
/// the failing one, on one runtime and on two.
pub(super) async fn run_noisy(ctx: &Ctx) -> Res<(String, Value)> {
    let events = ctx.opts.events as f64;
    let mut parts = Vec::new();
    let mut cases = Vec::new();
    let mut ratios = Vec::new();
    for runtimes in [1usize, 2] {
        let mut drains = Vec::new();
        let all = [
            Neighbour::None,
            Neighbour::Quiet,
            Neighbour::Failing,
            Neighbour::Blocking,
        ];
        for neighbour in all {
            drains.push(noisy_drain(ctx, runtimes, neighbour).await?);
            // Let the server settle, as between scenarios.
            actix_rt::time::sleep(Duration::from_millis(200)).await;
        }
        let [alone, quiet, beside, blocked] = [&drains[0], &drains[1], &drains[2], &drains[3]];
        let ratio = |base: &NoisyDrain| {
            base.seconds
                .zip(beside.seconds)
                .map(|(base, beside)| beside / base)
        };
        let (ratio, over_quiet) = (ratio(alone), ratio(quiet));
        let blocked_ratio = alone
            .seconds
            .zip(blocked.seconds)
            .map(|(base, beside)| beside / base);
        let drain = |d: &NoisyDrain| {
            d.seconds.map_or("INCOMPLETE".to_owned(), |s| {
                format!("{s:.2} s = {:.0}/s", events / s)
            })
        };
        let r = |r: Option<f64>| r.map_or("n/a".to_owned(), |r| format!("{r:.2}"));
        let mut part = format!(
            "{runtimes} runtime{}: alone {}, beside a quiet neighbour {}, beside the failing \
             neighbour {} (neighbour's attempts {:.0}, dead {:.0}), ratio {} (over the quiet \
             neighbour {}), beside a neighbour blocking its thread 200 ms per event {}, ratio {}",
            if runtimes == 1 { "" } else { "s" },
            drain(alone),
            drain(quiet),
            drain(beside),
            beside.neighbour_attempts,
            beside.neighbour_dead,
            r(ratio),
            r(over_quiet),
            drain(blocked),
            r(blocked_ratio),
        );
        for c in drains.iter().filter_map(|d| d.check.as_ref()) {
            part.push_str(&format!(" {c}"));
        }
        parts.push(part);
        for (d, neighbour) in drains.iter().zip(["none", "quiet", "failing", "blocking"]) {
            cases.push(json!({
                "runtimes": runtimes,
                "neighbour": neighbour,
                "seconds": d.seconds,
                "rate": d.seconds.map(|s| events / s),
                "neighbour_attempts": d.neighbour_attempts,
                "neighbour_dead": d.neighbour_dead,
                "check": d.check,
            }));
        }
        ratios.push(
            json!({"runtimes": runtimes, "ratio": ratio, "over_quiet": over_quiet,
            "blocking": blocked_ratio}),
        );
    }
    let line = format!(
        "noisy-neighbour | {} events, drain time with / alone | {}",
        ctx.opts.events,
        parts.join(" | ")
    );
    let result = json!({
        "scenario": "noisy-neighbour",
        "events": ctx.opts.events,
        "neighbour_retry": "fixed 1000 attempts, 200 ms",
        "cases": cases,
        "ratios": ratios,
    });
    Ok((line, result))
}
