//! `GET /charts`: each consumer's throughput and lag over a recent window, in time buckets,
//! from the stored stats samples — what the dashboard draws its charts from.

use std::time::Duration;

use actix_web::web;
use serde::Deserialize;
use serde_json::json;

use crate::admin::auth::Operator;
use crate::admin::error::*;
use crate::admin::State;
use crate::event::ConsumerName;
use crate::store;

use super::*;

/// The window unless `minutes` says otherwise: the samples' default history.
const DEFAULT_MINUTES: u64 = 60;
/// The longest window: a day, for a sampler configured with a longer history.
const MAX_MINUTES: u64 = 24 * 60;
/// About this many buckets per window, so a longer window costs no more points.
const BUCKETS: u64 = 60;
/// Most samples one request reads: an hour of 25 instances at the default 15 s. Past it the
/// oldest part of the window is left out, and the reply says so.
const MAX_SAMPLES: i64 = 6_000;

/// Query of `GET /charts`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ChartsQuery {
    minutes: Option<String>,
    consumer: Option<String>,
}

fn window_minutes(v: Option<String>) -> Result<u64, AdminError> {
    let (default, max) = (DEFAULT_MINUTES as i64, MAX_MINUTES as i64);
    whole_number(v, "minutes", default, max, INVALID_QUERY).map(|n| n as u64)
}

/// Whole minutes, so that buckets start on the minute whatever the window.
fn bucket_for(minutes: u64) -> Duration {
    Duration::from_secs(60 * minutes.div_ceil(BUCKETS))
}

pub(super) async fn charts(_: Operator, st: web::Data<State>, q: web::Query<ChartsQuery>) -> Reply {
    let q = q.into_inner();
    let minutes = window_minutes(q.minutes)?;
    let consumer = given(q.consumer)
        .map(|c| {
            ConsumerName::new(c.clone())
                .map(|_| c)
                .map_err(|e| AdminError::bad_request(INVALID_CONSUMER, e.to_string()))
        })
        .transpose()?;
    let bucket = bucket_for(minutes);
    let mut conn = st.pool.get().await?;
    let series = store::stats::chart_series(
        &mut conn,
        Duration::from_secs(minutes * 60),
        bucket,
        MAX_SAMPLES,
        consumer.as_deref(),
    )
    .await?;
    drop(conn);
    let mut consumers: Vec<serde_json::Value> = Vec::new();
    for chunk in series.points.chunk_by(|a, b| a.consumer == b.consumer) {
        let points: Vec<_> = chunk
            .iter()
            .map(|p| {
                json!({
                    "at": p.at,
                    "processed": p.processed,
                    "processed_per_second": p.per_second,
                    "backlog": p.backlog,
                    "oldest_due_age_seconds": p.oldest_due_age,
                    "instances": p.instances,
                })
            })
            .collect();
        consumers.push(json!({"consumer": chunk[0].consumer, "points": points}));
    }
    Ok(ok_json(json!({
        "until": series.until,
        "minutes": minutes,
        "bucket_seconds": bucket.as_secs(),
        "samples": series.samples,
        "truncated": series.samples >= MAX_SAMPLES,
        "consumers": consumers,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_cut_into_about_sixty_whole_minute_buckets() {
        assert_eq!(bucket_for(1), Duration::from_secs(60));
        assert_eq!(bucket_for(60), Duration::from_secs(60));
        assert_eq!(bucket_for(61), Duration::from_secs(120));
        assert_eq!(bucket_for(MAX_MINUTES), Duration::from_secs(24 * 60));
    }

    #[test]
    fn the_window_is_checked() {
        assert_eq!(window_minutes(None).unwrap(), 60);
        assert_eq!(window_minutes(Some(" ".into())).unwrap(), 60);
        assert_eq!(window_minutes(Some("1440".into())).unwrap(), 1440);
        for bad in ["0", "1441", "-5", "1.5", "an hour"] {
            let e = window_minutes(Some(bad.into())).unwrap_err();
            assert_eq!(e.code, INVALID_QUERY, "{bad}");
        }
    }
}
