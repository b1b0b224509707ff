//! The outbox and inbox leave room on each page for every row's one update (the migration
//! `update_room`): the PUBLISHED and PROCESSED versions are written beside the rows they
//! replace, so PostgreSQL logs only the bytes that changed instead of the whole row, payload
//! included. What that saves is measured by the benchmark (`docs/performance.md`); this test
//! holds the property that makes it: where each version of each row lands.
//!
//! With the tables' default fillfactor (100), inserts fill each page, and nearly every update
//! finds no room on its row's page: checked by the same steps on a table reset to it.

use std::collections::HashMap;

use crate::common;

use common::*;
use diesel::sql_types::{BigInt, Text};
use diesel::QueryableByName;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

#[derive(QueryableByName)]
struct Place {
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = BigInt)]
    page: i64,
}

/// Each row's heap page, by its id (which its updates keep).
async fn pages(db: &TestDb, table: &str) -> HashMap<String, i64> {
    let mut conn = db.pool.get().await.unwrap();
    let sql = format!("SELECT id::text AS key, (ctid::text::point)[0]::int8 AS page FROM {table}");
    let rows: Vec<Place> = diesel::sql_query(sql).load(&mut conn).await.unwrap();
    rows.into_iter().map(|p| (p.key, p.page)).collect()
}

/// How many of `before`'s rows are on another page now.
async fn moved(db: &TestDb, table: &str, before: &HashMap<String, i64>) -> usize {
    let after = pages(db, table).await;
    assert_eq!(
        after.len(),
        before.len(),
        "{table}: rows appeared or vanished"
    );
    before.iter().filter(|(k, p)| after[*k] != **p).count()
}

/// Publishes and processes `EVENTS` events written in one transaction (pages filled as far as
/// the fillfactor lets inserts fill them) and returns how many outbox and inbox rows moved to
/// another page when they were marked PUBLISHED and PROCESSED.
async fn run(db: &TestDb) -> (usize, usize) {
    const EVENTS: i64 = 400;
    let c = actix_outbox::event::ConsumerName::new("c").unwrap();
    let mut conn = db.pool.get().await.unwrap();
    // Paused, so that the inbox rows wait RECEIVED until their places are read.
    actix_outbox::ops::pause_consumer(&mut conn, &c, "test", "hold the inbox", None)
        .await
        .unwrap();
    db.produce_batched(EVENTS as usize, EVENTS as usize, "p")
        .await;
    let outbox = pages(db, "actix_outbox.outbox_events").await;
    let rt = start(db, vec![(consumer("c", 3), Behaviour::default())]).await;
    let received = "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'RECEIVED'";
    assert_eq!(db.wait_for(received, EVENTS, WAIT).await, EVENTS);
    let outbox_moved = moved(db, "actix_outbox.outbox_events", &outbox).await;
    let inbox = pages(db, "actix_outbox.inbox_events").await;
    actix_outbox::ops::resume_consumer(&mut conn, &c, "test")
        .await
        .unwrap();
    drop(conn);
    let processed =
        "SELECT count(*) AS n FROM actix_outbox.inbox_events WHERE status = 'PROCESSED'";
    assert_eq!(db.wait_for(processed, EVENTS, WAIT).await, EVENTS);
    let inbox_moved = moved(db, "actix_outbox.inbox_events", &inbox).await;
    rt.shutdown().await;
    (outbox_moved, inbox_moved)
}

#[actix_rt::test]
async fn a_rows_published_and_processed_versions_stay_on_its_page() {
    let db = TestDb::new().await;
    let (outbox, inbox) = run(&db).await;
    // A page filled to half by inserts takes all its rows' new versions (none moved when this
    // was written). The slack is for the bytes each version grows by (a timestamp set): with
    // another payload size, a page's last row could just miss.
    assert!(
        outbox <= 8,
        "{outbox} of 400 outbox rows moved to another page"
    );
    assert!(
        inbox <= 8,
        "{inbox} of 400 inbox rows moved to another page"
    );
    db.finish(&[]).await;
}

/// The same steps with the tables' fillfactor reset to PostgreSQL's default: what the test
/// above would see without the migration.
#[actix_rt::test]
async fn without_the_room_most_rows_move() {
    let db = TestDb::new().await;
    let mut conn = db.pool.get().await.unwrap();
    conn.batch_execute(
        "ALTER TABLE actix_outbox.outbox_events RESET (fillfactor); ALTER TABLE actix_outbox.inbox_events RESET (fillfactor)",
    )
    .await
    .unwrap();
    drop(conn);
    let (outbox, inbox) = run(&db).await;
    // All 400 outbox rows and 318 inbox rows moved when this was written.
    assert!(outbox > 200, "only {outbox} of 400 outbox rows moved");
    assert!(inbox > 200, "only {inbox} of 400 inbox rows moved");
    db.finish(&[]).await;
}
