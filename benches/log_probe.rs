//! A probe of storage v2's shape (`docs/storage-v2.md`), in SQL alone, before any of it is
//! built: what a log stamped with positions in commit order, read by one cursor per
//! (consumer, partition), costs PostgreSQL. No actix, no handler calls: only the statements
//! the design would send, so its figures are the storage's floor, to set beside `delivery`'s
//! WAL per event and its server-side share.
//!
//! ```text
//! cargo bench --bench log_probe -- [--events N] [--consumers C] [--parts P] [--batch B]
//!     [--stamp S] [--stamp-by update|move|ranges] [--stampers K] [--stall-ms M]
//!     [--hold-snapshot] [--effects-per-batch]
//! ```
//!
//! - A backlog of N events is written first, 500 per transaction, into `probe_log` (the
//!   outbox's columns that a delivery reads, with a `part` computed from the aggregate; its
//!   indexes: the key, the operator's lookups by correlation id and by time, and what the
//!   stamping mode reads by).
//! - Then one stamper gives the committed unstamped rows positions, S per transaction, from a
//!   one-row counter (`UPDATE probe_head SET last = last + n`), whose row lock is held until
//!   the stamp commits: the invariant the design rests on. `--stampers K` runs K stampers at
//!   once (each takes the rows the others have not locked), and `--stall-ms M` holds every
//!   other stamp's transaction open M ms after its stamp, before its COMMIT: a cursor that
//!   passed a stalled stamp's positions would miss its events, which the count below shows. `--stamp-by`: how (see [`Mode`]); `update`
//!   by default.
//! - Meanwhile C consumers × P partitions of loops each run batches in one transaction: lock
//!   the partition's cursor row, read up to B stamped rows past it, write one effect row per
//!   event (one statement per event, as a one-per-call handler does; `--effects-per-batch`:
//!   one statement per batch, as a batch handler does), move the cursor, commit.
//! - Done when every consumer has an effect for every event. The effects table's primary key
//!   is (consumer, event): a duplicate fails the run, and the count checks that none is
//!   missing.
//! - WAL is the server-wide `pg_current_wal_lsn()` difference over the whole scenario (backlog
//!   included) divided by the events, as `delivery` measures it.
//! - `--hold-snapshot`: another session holds a `REPEATABLE READ` snapshot from before the
//!   drain until it ends, so vacuum can remove none of the versions the drain leaves.
//!
//! Everything lives in a database of its own, dropped at the end.

#[path = "../tests/common/url.rs"]
mod url;
use url::with_database;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio_postgres::{Client, NoTls};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Clone)]
struct Opts {
    events: i64,
    consumers: i32,
    parts: i32,
    batch: i64,
    stamp: i64,
    hold_snapshot: bool,
    effects_per_batch: bool,
    mode: Mode,
    stampers: usize,
    stall_ms: u64,
}

/// How a stamp gives committed events their positions.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// It updates each log row's `position` (the shape `docs/storage-v2.md` proposes).
    InPlace,
    /// Producers write into an outbox table of their own; a stamp moves the rows into the log
    /// (a delete there, an insert here), so the log is insert-only.
    Move,
    /// Producers write the log row and a one-column queue row; a stamp deletes queue rows and
    /// inserts one row per partition naming its events' `seq`s in order, so no log row is
    /// ever updated. A consumer's batch is one such row.
    Ranges,
}

fn opts() -> Res<Opts> {
    let mut o = Opts {
        events: 20_000,
        consumers: 1,
        parts: 4,
        batch: 250,
        stamp: 1_000,
        hold_snapshot: false,
        effects_per_batch: false,
        mode: Mode::InPlace,
        stampers: 1,
        stall_ms: 0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--events" => o.events = value()?.parse()?,
            "--consumers" => o.consumers = value()?.parse()?,
            "--parts" => o.parts = value()?.parse()?,
            "--batch" => o.batch = value()?.parse()?,
            "--stamp" => o.stamp = value()?.parse()?,
            "--hold-snapshot" => o.hold_snapshot = true,
            "--effects-per-batch" => o.effects_per_batch = true,
            "--stampers" => o.stampers = value()?.parse()?,
            "--stall-ms" => o.stall_ms = value()?.parse()?,
            "--stamp-by" => {
                o.mode = match value()?.as_str() {
                    "update" => Mode::InPlace,
                    "move" => Mode::Move,
                    "ranges" => Mode::Ranges,
                    other => {
                        return Err(format!("--stamp-by {other}: update, move or ranges").into())
                    }
                }
            }
            // `cargo bench` passes `--bench`.
            "--bench" => {}
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if o.events < 1
        || o.consumers < 1
        || o.parts < 1
        || o.batch < 1
        || o.stamp < 1
        || o.stampers < 1
    {
        return Err("every count must be positive".into());
    }
    Ok(o)
}

async fn client(url: &str) -> Res<Client> {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let o = opts()?;
    let Ok(server) = std::env::var("DATABASE_URL") else {
        println!("log_probe | skipped: set DATABASE_URL to a server (its database is not used)");
        return Ok(());
    };
    let db = format!("log_probe_{}", std::process::id());
    let admin = client(&server).await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await?;
    let run = probe(&with_database(&server, &db), &o).await;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    run
}

async fn probe(url: &str, o: &Opts) -> Res<()> {
    let setup = client(url).await?;
    setup
        .batch_execute(&format!(
            "CREATE TABLE probe_log (
                 id             uuid        PRIMARY KEY,
                 seq            bigserial   NOT NULL,
                 event_type     text        NOT NULL,
                 aggregate_id   text        NOT NULL,
                 part           integer     NOT NULL,
                 payload        jsonb       NOT NULL,
                 metadata       jsonb       NOT NULL DEFAULT '{{}}',
                 correlation_id text        NOT NULL,
                 created_at     timestamptz NOT NULL DEFAULT now(),
                 position       bigint
             );
             {indexes}
             CREATE TABLE probe_queue (seq bigint PRIMARY KEY);
             CREATE TABLE probe_stamps (
                 part     integer  NOT NULL,
                 position bigint   NOT NULL,
                 seqs     bigint[] NOT NULL,
                 PRIMARY KEY (part, position)
             );
             -- What the operator API looks events up by, as on today's outbox.
             CREATE INDEX probe_log_correlation ON probe_log (correlation_id);
             CREATE INDEX probe_log_created ON probe_log (created_at);
             CREATE TABLE probe_outbox (
                 id             uuid        PRIMARY KEY,
                 seq            bigserial   NOT NULL,
                 event_type     text        NOT NULL,
                 aggregate_id   text        NOT NULL,
                 payload        jsonb       NOT NULL,
                 metadata       jsonb       NOT NULL DEFAULT '{{}}',
                 correlation_id text        NOT NULL,
                 created_at     timestamptz NOT NULL DEFAULT now()
             );
             CREATE INDEX probe_outbox_seq ON probe_outbox (seq);
             CREATE TABLE probe_head (one boolean PRIMARY KEY DEFAULT true, last bigint NOT NULL);
             INSERT INTO probe_head (last) VALUES (0);
             CREATE TABLE probe_cursors (
                 consumer text    NOT NULL,
                 part     integer NOT NULL,
                 position bigint  NOT NULL DEFAULT 0,
                 PRIMARY KEY (consumer, part)
             );
             INSERT INTO probe_cursors (consumer, part)
                 SELECT 'c' || c, p FROM generate_series(1, {c}) c, generate_series(0, {p} - 1) p;
             CREATE TABLE probe_effects (
                 consumer text   NOT NULL,
                 event_id uuid   NOT NULL,
                 order_id text   NOT NULL,
                 PRIMARY KEY (consumer, event_id)
             );",
            c = o.consumers,
            p = o.parts,
            indexes = match o.mode {
                Mode::InPlace => {
                    "CREATE INDEX probe_log_unstamped ON probe_log (seq) WHERE position IS NULL;
                     CREATE INDEX probe_log_read ON probe_log (part, position)
                         WHERE position IS NOT NULL;"
                }
                Mode::Move => "CREATE INDEX probe_log_read ON probe_log (part, position);",
                Mode::Ranges => "CREATE UNIQUE INDEX probe_log_seq ON probe_log (seq);",
            },
        ))
        .await?;
    let wal_from: String = setup
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);

    // The backlog, 500 events per transaction.
    let written = Instant::now();
    let insert = setup
        .prepare(match o.mode {
            Mode::Move => {
                "INSERT INTO probe_outbox (id, event_type, aggregate_id, payload, correlation_id)
                 SELECT gen_random_uuid(), 'order.created', 'o' || n, jsonb_build_object('n', n),
                        'c' || n
                 FROM generate_series($1::bigint, $2::bigint) n"
            }
            Mode::InPlace => {
                "INSERT INTO probe_log (id, event_type, aggregate_id, part, payload, correlation_id)
                 SELECT gen_random_uuid(), 'order.created', 'o' || n,
                        abs(hashtext('o' || n)) % $3, jsonb_build_object('n', n), 'c' || n
                 FROM generate_series($1::bigint, $2::bigint) n"
            }
            Mode::Ranges => {
                "WITH l AS (
                     INSERT INTO probe_log (id, event_type, aggregate_id, part, payload,
                                            correlation_id)
                     SELECT gen_random_uuid(), 'order.created', 'o' || n,
                            abs(hashtext('o' || n)) % $3, jsonb_build_object('n', n), 'c' || n
                     FROM generate_series($1::bigint, $2::bigint) n
                     RETURNING seq
                 )
                 INSERT INTO probe_queue (seq) SELECT seq FROM l"
            }
        })
        .await?;
    let mut n = 0;
    while n < o.events {
        let last = (n + 500).min(o.events);
        if o.mode == Mode::Move {
            setup.execute(&insert, &[&(n + 1), &last]).await?;
        } else {
            setup.execute(&insert, &[&(n + 1), &last, &o.parts]).await?;
        }
        n = last;
    }
    let write_rate = o.events as f64 / written.elapsed().as_secs_f64();

    let holder = if o.hold_snapshot {
        let h = client(url).await?;
        h.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM probe_head")
            .await?;
        Some(h)
    } else {
        None
    };

    let started = Instant::now();
    let stamped_all = Arc::new(AtomicBool::new(false));
    let live = Arc::new(AtomicUsize::new(o.stampers));
    let stampers: Vec<_> = (0..o.stampers)
        .map(|_| {
            let (url, o, done, live) =
                (url.to_owned(), o.clone(), stamped_all.clone(), live.clone());
            tokio::spawn(async move {
                let stamped = stamp(&url, &o).await;
                // The last stamper out: every stamp has committed.
                if live.fetch_sub(1, Ordering::SeqCst) == 1 {
                    done.store(true, Ordering::SeqCst);
                }
                stamped
            })
        })
        .collect();
    let mut loops = Vec::new();
    for c in 1..=o.consumers {
        for p in 0..o.parts {
            let (url, o, done) = (url.to_owned(), o.clone(), stamped_all.clone());
            loops.push(tokio::spawn(async move {
                consume(&url, &o, &format!("c{c}"), p, &done).await
            }));
        }
    }
    let (mut stamps, mut stamp_ms) = (0, 0.0);
    for s in stampers {
        let (n, ms) = s.await??;
        (stamps, stamp_ms) = (stamps + n, stamp_ms + ms);
    }
    let mut batches = 0;
    for l in loops {
        batches += l.await??;
    }
    let drain = started.elapsed();
    drop(holder);

    let wal: f64 = setup
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
            &[&wal_from],
        )
        .await?
        .get(0);
    let effects: i64 = setup
        .query_one("SELECT count(*) FROM probe_effects", &[])
        .await?
        .get(0);
    let expected = o.events * i64::from(o.consumers);
    println!(
        "log_probe | {} events, {} consumer(s) × {} partitions, batches of {}, stamps of {}{}{}{}",
        o.events,
        o.consumers,
        o.parts,
        o.batch,
        o.stamp,
        if o.effects_per_batch {
            ", effects per batch"
        } else {
            ", effects per event"
        },
        match o.mode {
            Mode::InPlace => ", stamped in place",
            Mode::Move => ", stamped by moving",
            Mode::Ranges => ", stamped as ranges",
        },
        if o.hold_snapshot {
            ", a snapshot held"
        } else {
            ""
        },
    );
    println!(
        "log_probe | drain {:.0}/s (backlog written at {:.0}/s) | WAL {:.0} B/event | {} stamps \
         ({:.1} ms each) | {} batches | effects {}/{} {}",
        o.events as f64 / drain.as_secs_f64(),
        write_rate,
        wal / o.events as f64,
        stamps,
        stamp_ms / stamps.max(1) as f64,
        batches,
        effects,
        expected,
        if effects == expected {
            "exactly once"
        } else {
            "MISSING"
        },
    );
    if effects != expected {
        return Err("effects missing".into());
    }
    Ok(())
}

/// Stamps committed unstamped rows that no other stamper holds, `stamp` per transaction, until
/// none is left (the backlog is complete before the drain starts). Returns the stamps and
/// their total time in ms, stalls included.
async fn stamp(url: &str, o: &Opts) -> Res<(u64, f64)> {
    let mut db = client(url).await?;
    // One statement: lock the next rows, take their positions from the counter (its row lock
    // held until COMMIT), write them.
    let moving = db
        .prepare(
            "WITH moved AS (
                 DELETE FROM probe_outbox WHERE seq = ANY (ARRAY(
                     SELECT seq FROM probe_outbox ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED))
                 RETURNING *
             ), head AS (
                 UPDATE probe_head SET last = last + (SELECT count(*) FROM moved)
                 RETURNING last - (SELECT count(*) FROM moved) AS base
             )
             INSERT INTO probe_log (id, seq, event_type, aggregate_id, part, payload, metadata,
                                    correlation_id, created_at, position)
             SELECT m.id, m.seq, m.event_type, m.aggregate_id,
                    abs(hashtext(m.aggregate_id)) % $2, m.payload, m.metadata,
                    m.correlation_id, m.created_at,
                    head.base + row_number() OVER (ORDER BY m.seq)
             FROM moved m, head",
        )
        .await?;
    let ranges = db
        .prepare(
            "WITH q AS (
                 DELETE FROM probe_queue WHERE seq = ANY (ARRAY(
                     SELECT seq FROM probe_queue ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED))
                 RETURNING seq
             ), head AS (
                 UPDATE probe_head SET last = last + 1 RETURNING last
             )
             INSERT INTO probe_stamps (part, position, seqs)
             SELECT l.part, head.last, array_agg(l.seq ORDER BY l.seq)
             FROM q JOIN probe_log l ON l.seq = q.seq, head
             GROUP BY l.part, head.last",
        )
        .await?;
    let stamp = db
        .prepare(
            "WITH todo AS (
                 SELECT id, row_number() OVER (ORDER BY seq) AS k
                 FROM (SELECT id, seq FROM probe_log WHERE position IS NULL
                       ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED) t
             ), head AS (
                 UPDATE probe_head SET last = last + (SELECT count(*) FROM todo)
                 RETURNING last - (SELECT count(*) FROM todo) AS base
             )
             UPDATE probe_log l SET position = head.base + todo.k
             FROM todo, head WHERE l.id = todo.id",
        )
        .await?;
    let (mut stamps, mut ms) = (0u64, 0f64);
    loop {
        let t = Instant::now();
        let tx = db.transaction().await?;
        let n = match o.mode {
            Mode::Move => tx.execute(&moving, &[&o.stamp, &o.parts]).await?,
            Mode::InPlace => tx.execute(&stamp, &[&o.stamp]).await?,
            Mode::Ranges => tx.execute(&ranges, &[&o.stamp]).await?,
        };
        if o.stall_ms > 0 && n > 0 && stamps % 2 == 1 {
            // Positions taken, not yet visible: the counter row stays locked meanwhile.
            tx.execute(
                "SELECT pg_sleep($1::float8 / 1000)",
                &[&(o.stall_ms as f64)],
            )
            .await?;
        }
        tx.commit().await?;
        ms += t.elapsed().as_secs_f64() * 1e3;
        stamps += 1;
        if n == 0 {
            return Ok((stamps, ms));
        }
    }
}

/// One (consumer, partition) loop: batches until the stamper is done and nothing is left past
/// the cursor. Returns its batches.
async fn consume(
    url: &str,
    o: &Opts,
    consumer: &str,
    part: i32,
    stamped_all: &AtomicBool,
) -> Res<u64> {
    let mut db = client(url).await?;
    let cursor = db
        .prepare("SELECT position FROM probe_cursors WHERE consumer = $1 AND part = $2 FOR UPDATE")
        .await?;
    let read = db
        .prepare(if o.mode == Mode::Ranges {
            // One stamp's events of this partition (the batch size is the stamp's share).
            "SELECT l.id::text, s.position, l.aggregate_id
             FROM (SELECT position, seqs FROM probe_stamps
                   WHERE part = $1 AND position > $2 ORDER BY position LIMIT 1) s
             JOIN probe_log l ON l.seq = ANY (s.seqs)
             WHERE $3::bigint > 0
             ORDER BY l.seq"
        } else {
            "SELECT id::text, position, aggregate_id FROM probe_log
             WHERE part = $1 AND position > $2 ORDER BY position LIMIT $3"
        })
        .await?;
    let effect = db
        .prepare("INSERT INTO probe_effects (consumer, event_id, order_id) VALUES ($1, $2::text::uuid, $3)")
        .await?;
    let effects = db
        .prepare(
            "INSERT INTO probe_effects (consumer, event_id, order_id)
             SELECT $1, unnest($2::text[]::uuid[]), unnest($3::text[])",
        )
        .await?;
    let advance = db
        .prepare("UPDATE probe_cursors SET position = $3 WHERE consumer = $1 AND part = $2")
        .await?;
    let mut batches = 0;
    loop {
        // Read before the batch: a stamper done before this read means an empty batch is the end.
        let last_round = stamped_all.load(Ordering::SeqCst);
        let tx = db.transaction().await?;
        let at: i64 = tx.query_one(&cursor, &[&consumer, &part]).await?.get(0);
        let rows = tx.query(&read, &[&part, &at, &o.batch]).await?;
        let Some(last) = rows.last().map(|r| r.get::<_, i64>(1)) else {
            tx.commit().await?;
            if last_round {
                return Ok(batches);
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            continue;
        };
        if o.effects_per_batch {
            let ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            let orders: Vec<String> = rows.iter().map(|r| r.get(2)).collect();
            tx.execute(&effects, &[&consumer, &ids, &orders]).await?;
        } else {
            for r in &rows {
                let (id, order): (String, String) = (r.get(0), r.get(2));
                tx.execute(&effect, &[&consumer, &id, &order]).await?;
            }
        }
        tx.execute(&advance, &[&consumer, &part, &last]).await?;
        tx.commit().await?;
        batches += 1;
    }
}
