//! The event scenarios: `single`, `batched`, `drain`, `paced` and `fanout`: a producer writes
//! events (or a backlog, for `drain`) and the runtime delivers them.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    Single,
    Batched,
    Drain,
    Paced,
    Fanout,
}

pub(super) async fn start_runtime(
    ctx: &Ctx,
    track: &Arc<Track>,
    names: &[String],
) -> Res<OutboxRuntime> {
    let mut b = OutboxRuntime::builder(ctx.pool.clone()).config(ctx.opts.runtime_config());
    for (index, name) in names.iter().enumerate() {
        let (track, name_arc): (Arc<Track>, Arc<str>) = (track.clone(), Arc::from(name.as_str()));
        let sink = move || Sink {
            track: track.clone(),
            index,
            name: name_arc.clone(),
        };
        b = with_handler(
            b,
            ctx.opts.batch_handler,
            ctx.opts.consumer_config(name),
            sink,
        );
    }
    if ctx.opts.beside_blocking {
        let cfg = ctx.opts.consumer_config(NEIGHBOUR);
        b = with_handler(b, ctx.opts.batch_handler, cfg, || Blocking);
    }
    Ok(b.start().await?)
}

/// Waits until every consumer's handlers have all started and its inbox has nothing left to
/// do or in flight; returns when each consumer got there (in the track's clock), `None` past
/// the deadline.
pub(super) async fn wait_done(
    conn: &mut AsyncPgConnection,
    track: &Track,
    names: &[String],
    deadline: Instant,
) -> Res<Vec<Option<i64>>> {
    let mut done: Vec<Option<i64>> = vec![None; names.len()];
    loop {
        if (0..names.len()).any(|c| done[c].is_none() && track.all_started(c)) {
            let left: Vec<PerConsumer> = diesel::sql_query(
                "SELECT consumer, count(*) AS n FROM actix_outbox.inbox_events \
                 WHERE status IN ('RECEIVED', 'RETRY_PENDING', 'PROCESSING') \
                 GROUP BY consumer",
            )
            .load(conn)
            .await?;
            let at = track.now();
            for (c, name) in names.iter().enumerate() {
                let open = left.iter().any(|l| &l.consumer == name && l.n > 0);
                if done[c].is_none() && track.all_started(c) && !open {
                    done[c] = Some(at);
                }
            }
        }
        if done.iter().all(Option::is_some) || Instant::now() > deadline {
            return Ok(done);
        }
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
}

pub(super) async fn run_events(ctx: &Ctx, kind: Kind) -> Res<(String, Value)> {
    let o = &ctx.opts;
    let (events, per_tx, rate) = match kind {
        Kind::Paced => (o.paced_events, 1, Some(o.paced_rate)),
        Kind::Batched | Kind::Drain => (o.events, o.batch_per_tx, None),
        Kind::Single | Kind::Fanout => (o.events, 1, None),
    };
    let names: Vec<String> = match kind {
        Kind::Fanout => ["effects_a", "effects_b", "effects_c"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        _ => vec!["effects".to_owned()],
    };
    let mut mon = ctx.pool.get().await?;
    let track = Track::new(events, names.len());
    let produce_args = Produce {
        events,
        per_tx,
        rate,
        one_statement: ctx.opts.one_statement,
        payload_bytes: ctx.opts.payload_bytes,
    };

    let mut runtime = None;
    if kind != Kind::Drain {
        runtime = Some(start_runtime(ctx, &track, &names).await?);
        // Let the actors start and the listener connect, as the peers let their workers start.
        actix_rt::time::sleep(Duration::from_millis(300)).await;
    }
    let wal_window = WalWindow::open(&mut mon).await?;
    let wake = runtime.as_ref().map(|r| r.handle());
    let (url, t) = (ctx.url.clone(), track.clone());
    let produced = on_own_thread(move || produce(url, t, produce_args, wake)).await;
    let (enq_start, enq_end, txs) = match produced {
        Ok(p) => p,
        Err(e) => {
            if let Some(rt) = &runtime {
                rt.shutdown().await;
            }
            return Err(format!("producer: {e}").into());
        }
    };
    let mut from = enq_start;
    let mut holder = None;
    if kind == Kind::Drain {
        if o.hold_snapshot {
            // A connection of its own: the pool's end a transaction left idle after 60 s.
            let mut h = AsyncPgConnection::establish(&ctx.url).await?;
            h.batch_execute(
                "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM bench_effects",
            )
            .await?;
            holder = Some(h);
        }
        from = track.now();
        runtime = Some(start_runtime(ctx, &track, &names).await?);
    }
    let done = wait_done(&mut mon, &track, &names, Instant::now() + SCENARIO_LIMIT).await;
    if let Some(mut h) = holder {
        h.batch_execute("COMMIT").await?;
    }
    let wal = wal_window.close(&mut mon).await;
    if let Some(rt) = &runtime {
        rt.shutdown().await;
    }
    let (done, (wal, wal_db)) = (done?, wal?);
    let effects = number(&mut mon, "SELECT count(*)::float8 AS n FROM bench_effects").await?;
    let dup_effects = number(
        &mut mon,
        "SELECT (count(*) - count(DISTINCT (consumer, event_id)))::float8 AS n FROM bench_effects",
    )
    .await?;
    drop(mon);

    let secs = |ns: i64| ns as f64 / 1e9;
    let enqueue_rate = events as f64 / secs(enq_end - enq_start);
    let per_consumer: Vec<Option<f64>> = done
        .iter()
        .map(|d| d.map(|d| events as f64 / secs(d - from)))
        .collect();
    let complete = done.iter().all(Option::is_some);
    let e2e = done
        .iter()
        .copied()
        .collect::<Option<Vec<i64>>>()
        .and_then(|d| d.into_iter().max())
        .map(|last| events as f64 / secs(last - from));
    let (lat, missing) = track.latencies();
    let wal_per_event = wal / events as f64;
    let wal_db_per_event = wal_db.map(|w| w / events as f64);
    let rss = peak_rss_mib();
    let duplicates = track.duplicates();
    let fmt_rate = |r: Option<f64>| r.map_or("INCOMPLETE".to_owned(), |r| format!("{r:.0}/s"));

    let name = match kind {
        Kind::Single => "single",
        Kind::Batched => "batched",
        Kind::Drain => "drain",
        Kind::Paced => "paced",
        Kind::Fanout => "fanout",
    };
    let mut line = format!("{name:<8}| ");
    match kind {
        Kind::Drain => line.push_str(&format!(
            "drain {} (backlog written at {enqueue_rate:.0}/s, {txs} tx, runtime stopped{})",
            fmt_rate(e2e),
            if o.hold_snapshot {
                ", a snapshot held throughout"
            } else {
                ""
            }
        )),
        Kind::Paced => line.push_str(&format!(
            "{} at {:.0}/s | e2e {} | {}",
            events,
            o.paced_rate,
            fmt_rate(e2e),
            lat_text(&lat, true)
        )),
        Kind::Fanout => {
            let each: Vec<String> = names
                .iter()
                .zip(&per_consumer)
                .map(|(n, r)| format!("{n} {}", fmt_rate(*r)))
                .collect();
            line.push_str(&format!(
                "enq {enqueue_rate:.0}/s ({txs} tx) | per consumer {} | {}",
                each.join(" "),
                lat_text(&lat, false)
            ))
        }
        Kind::Single | Kind::Batched => line.push_str(&format!(
            "enq {enqueue_rate:.0}/s ({txs} tx) | e2e {} | {}",
            fmt_rate(e2e),
            lat_text(&lat, false)
        )),
    }
    line.push_str(&format!(
        " | WAL {wal_per_event:.0} B/event (this db {}) | peak RSS {rss:.1} MiB{}",
        wal_db_per_event.map_or("n/a".to_owned(), |w| format!("{w:.0}")),
        if ctx.rss_resets { "" } else { " (since start)" }
    ));
    let expected = (events * names.len()) as f64;
    if effects != expected || dup_effects > 0.0 || missing > 0 || duplicates > 0 {
        line.push_str(&format!(
            " | CHECK effects {effects}/{expected} dup effects {dup_effects} missing starts \
             {missing} redeliveries {duplicates}"
        ));
    }
    let result = json!({
        "scenario": name,
        "events": events,
        "per_tx": per_tx,
        "transactions": txs,
        "consumers": names,
        "enqueue_rate": enqueue_rate,
        "e2e_rate": e2e,
        "per_consumer_rate": per_consumer,
        "complete": complete,
        "latency": if kind == Kind::Drain { Value::Null } else { lat_json(&lat, missing) },
        "wal_bytes_per_event": wal_per_event,
        "wal_bytes_per_event_this_db": wal_db_per_event,
        "peak_rss_mib": rss,
        "effects": effects,
        "duplicate_effects": dup_effects,
        "redeliveries": duplicates,
    });
    Ok((line, result))
}
