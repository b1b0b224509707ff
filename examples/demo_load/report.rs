//! `GET /stats` and the delivery report made from it.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::process::ExitCode;
use std::time::Duration;

use serde::Deserialize;

use crate::client::Client;
use crate::{client, read_summary, Fatal, Opts};

type Counts = BTreeMap<String, i64>;

/// The body of `GET /stats`, which the service builds in SQL (`order_service/stats.rs`); see
/// there for what each figure means. Every field is required, so a renamed one fails the
/// report instead of reading as zero.
#[derive(Debug, Deserialize)]
pub struct Stats {
    orders: Counts,
    orders_by_source: Counts,
    events_written: i64,
    events_by_status: Counts,
    outbox: Counts,
    outbox_pending: i64,
    inbox: BTreeMap<String, Counts>,
    inbox_open: i64,
    inbox_retries: Counts,
    dead_letters: DeadLetters,
    duplicates_absorbed: Duplicates,
    notification_jobs: Counts,
    notification_jobs_by_creator: Counts,
    notification_send_retries: i64,
    analytics: Counts,
    reconcile: Reconcile,
    reconcile_repairs_by_source: Counts,
    drift: Drift,
    latency_ms: BTreeMap<String, Latency>,
}

#[derive(Debug, Deserialize)]
struct DeadLetters {
    outbox: i64,
    inbox: i64,
}

#[derive(Debug, Deserialize)]
struct Duplicates {
    redeliveries: i64,
    idempotency_keys: i64,
}

#[derive(Debug, Deserialize)]
struct Reconcile {
    runs: i64,
}

#[derive(Debug, Deserialize)]
struct Drift {
    completed_without_notification: i64,
}

#[derive(Debug, Deserialize)]
struct Latency {
    p50: Option<f64>,
    p99: Option<f64>,
}

impl Stats {
    /// What is still on its way, by name.
    pub fn in_flight(&self) -> [(&'static str, i64); 4] {
        let jobs = |state: &str| self.notification_jobs.get(state).copied().unwrap_or(0);
        [
            ("outbox pending", self.outbox_pending),
            ("inbox open", self.inbox_open),
            ("notifications unsent", jobs("PENDING")),
            (
                "completed without job",
                self.drift.completed_without_notification,
            ),
        ]
    }
}

/// The stats; `None` when the service gave no answer.
pub async fn fetch_stats(client: &mut Client) -> Result<Option<Stats>, Fatal> {
    let Ok(resp) = client.get("/stats", &[]).await else {
        return Ok(None);
    };
    if resp.status != 200 {
        return Err(Fatal(format!(
            "GET /stats -> {} {}",
            resp.status,
            resp.text()
        )));
    }
    resp.json()
        .map(Some)
        .map_err(|e| Fatal(format!("GET /stats: {e}")))
}

pub fn join(items: impl IntoIterator<Item = impl Display>, sep: &str) -> String {
    items
        .into_iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(sep)
}

/// `A 1, B 2`, by name.
fn counts(c: &Counts) -> String {
    join(c.iter().map(|(k, n)| format!("{k} {n}")), ", ")
}

pub async fn cmd_report(opts: &Opts) -> Result<ExitCode, Fatal> {
    let mut client = client(opts.url()?, Duration::from_secs(10))?;
    let s = fetch_stats(&mut client)
        .await?
        .ok_or_else(|| Fatal("GET /stats: no answer".into()))?;
    let load = read_summary(opts.str("summary"))?;

    let consumers: Vec<&String> = s.inbox.keys().collect();
    let by_source = &s.orders_by_source;
    let imported: i64 = by_source
        .iter()
        .filter(|(src, _)| *src != "api")
        .map(|(_, n)| n)
        .sum();
    // Both from the jobs the repairs made (each commits on its own); reconcile_runs is written at
    // a run's end, so a run cut off by the crash is missing from its figures.
    let repairs = &s.reconcile_repairs_by_source;
    let imported_repaired: i64 = repairs
        .iter()
        .filter(|(src, _)| *src != "api")
        .map(|(_, n)| n)
        .sum();
    let api_repaired = repairs.get("api").copied().unwrap_or(0);
    let fmt_lat = |name: &str| {
        let ms = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:?}"));
        let l = s.latency_ms.get(name);
        format!(
            "p50 {} ms, p99 {} ms",
            ms(l.and_then(|l| l.p50)),
            ms(l.and_then(|l| l.p99))
        )
    };
    let dup = &s.duplicates_absorbed;
    let dead = &s.dead_letters;

    let mut rows: Vec<(&str, String)> = vec![
        (
            "orders",
            format!(
                "{} ({} through the API, {imported} written around it without events); {}",
                s.orders.values().sum::<i64>(),
                by_source.get("api").copied().unwrap_or(0),
                counts(&s.orders)
            ),
        ),
        (
            "events written",
            format!(
                "{} ORDER_STATUS_CHANGED ({}); outbox: {}",
                s.events_written,
                counts(&s.events_by_status),
                counts(&s.outbox)
            ),
        ),
        (
            "delivered",
            join(
                consumers.iter().map(|c| {
                    let processed = s.inbox[*c].get("PROCESSED").copied().unwrap_or(0);
                    format!("{c} {processed} PROCESSED")
                }),
                "; ",
            ),
        ),
        (
            "duplicates absorbed",
            format!(
                "{} repeated handler calls (redeliveries after the crash and batches replayed \
                 after a failure; their effects rolled back, never repeated); {} events whose \
                 notification already existed (idempotency key); {} repeated creates answered \
                 with the order their first attempt made",
                dup.redeliveries,
                dup.idempotency_keys,
                load.as_ref().map_or(0, |l| l.creates_replayed)
            ),
        ),
        (
            "retries",
            format!(
                "inbox {} ({}); provider sends {}",
                s.inbox_retries.values().sum::<i64>(),
                join(
                    consumers.iter().map(|c| format!(
                        "{c} {}",
                        s.inbox_retries.get(*c).copied().unwrap_or(0)
                    )),
                    ", "
                ),
                s.notification_send_retries
            ),
        ),
        (
            "dead letters",
            format!(
                "{} (outbox {}, inbox {})",
                dead.outbox + dead.inbox,
                dead.outbox,
                dead.inbox
            ),
        ),
        (
            "drift repaired",
            format!(
                "{} notifications made by the reconciler over {} recorded runs ({imported_repaired} \
                 for orders written around the service, never announced; {api_repaired} for \
                 orders that had events)",
                imported_repaired + api_repaired,
                s.reconcile.runs
            ),
        ),
        (
            "delivery latency",
            format!(
                "{} ({})",
                fmt_lat("all"),
                join(
                    consumers.iter().map(|c| format!("{c} {}", fmt_lat(c))),
                    "; "
                )
            ),
        ),
        (
            "notification jobs",
            format!(
                "{} (created by {})",
                counts(&s.notification_jobs),
                counts(&s.notification_jobs_by_creator)
            ),
        ),
        ("analytics", counts(&s.analytics)),
    ];
    if let Some(l) = &load {
        rows.push((
            "load",
            format!(
                "{} requests in {:.1}s; {} without an answer; creates repeated {}; status changes \
                 found committed by a read-back {}, repeated after one {}, refused as already \
                 COMPLETED {}",
                l.requests,
                l.seconds,
                l.transport_errors + l.server_errors,
                l.creates_repeated,
                l.confirmed_by_read,
                l.status_changes_repeated,
                l.already_completed
            ),
        ));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!("== delivery report ==");
    for (k, v) in rows {
        println!("  {k:<width$}  {v}");
    }
    Ok(ExitCode::SUCCESS)
}
