//! The redelivery check ([`Harness::check_redelivery`]): each due event delivered, crashed
//! before its commit, and delivered again, with the consumer's effects read from the database
//! between the steps.

use std::fmt;

use diesel::sql_types::Text;
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;

use super::{Harness, Outcome};
use crate::error::{Error, Result};
use crate::event::{ConsumerName, EventId};
use crate::store::PgPool;

/// What [`Harness::check_redelivery`] found: one [`RedeliveryCheck`] per event it delivered.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RedeliveryReport {
    /// In delivery order.
    pub checks: Vec<RedeliveryCheck>,
}

/// One event delivered, crashed before its commit, and delivered again.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RedeliveryCheck {
    /// The consumer.
    pub consumer: ConsumerName,
    /// The event.
    pub event_id: EventId,
    /// The event type.
    pub event_type: String,
    /// The effect rows the crashed delivery left behind: what changed although its
    /// transaction rolled back. Empty for a consumer that writes only through its delivery.
    pub crash: EffectChanges,
    /// The effect rows the redelivery changed on top of those. Empty for a consumer whose
    /// outside write is keyed (an idempotency key, an upsert by event id).
    pub redelivery: EffectChanges,
    /// The redelivery, which commits: its handler's result and the row's state after it.
    pub outcome: Outcome,
}

/// How the rows of the effects query changed between two reads, compared as text
/// (`to_jsonb(row)::text`) and as a multiset: two equal rows are two effects.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct EffectChanges {
    /// Rows that appeared (an update shows as a row removed and a row added), sorted.
    pub added: Vec<String>,
    /// Rows that disappeared, sorted.
    pub removed: Vec<String>,
}

impl EffectChanges {
    /// No row changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }

    fn between(before: &[String], after: &[String]) -> Self {
        EffectChanges {
            added: minus(after, before),
            removed: minus(before, after),
        }
    }
}

impl RedeliveryCheck {
    /// False when the crashed delivery left effects behind *and* the redelivery changed them
    /// again: the consumer writes outside its delivery's transaction, and each crash repeats
    /// that write.
    pub fn is_idempotent(&self) -> bool {
        self.crash.is_empty() || self.redelivery.is_empty()
    }
}

impl RedeliveryReport {
    /// Whether every event checked is idempotent (true for a report of no event).
    pub fn is_idempotent(&self) -> bool {
        self.checks.iter().all(RedeliveryCheck::is_idempotent)
    }

    /// The events that are not idempotent.
    pub fn findings(&self) -> impl Iterator<Item = &RedeliveryCheck> {
        self.checks.iter().filter(|c| !c.is_idempotent())
    }

    /// Panics, with the report, unless every event checked is idempotent; panics as well when
    /// no event was checked, since that proves nothing (nothing was due: publish first).
    #[track_caller]
    pub fn assert_idempotent(&self) {
        if self.checks.is_empty() {
            panic!(
                "check_redelivery delivered no event: nothing was due (publish the events with \
                 Harness::publish first, and advance the clock to a retry)"
            );
        }
        if !self.is_idempotent() {
            panic!("{self}");
        }
    }
}

impl fmt::Display for RedeliveryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let findings: Vec<&RedeliveryCheck> = self.findings().collect();
        if findings.is_empty() {
            return write!(
                f,
                "{} event(s) delivered again after a crash before commit: no effect repeated",
                self.checks.len()
            );
        }
        writeln!(
            f,
            "{} of {} event(s) are not idempotent: the crashed delivery left effects behind, \
             and the redelivery added more. The consumer writes outside its delivery's \
             transaction; write through Delivery::conn, or key the outside write by the event \
             id.",
            findings.len(),
            self.checks.len()
        )?;
        for check in findings {
            writeln!(
                f,
                "- {} {} {}:",
                check.consumer, check.event_type, check.event_id
            )?;
            rows(f, "left behind by the crash", &check.crash)?;
            rows(f, "changed by the redelivery", &check.redelivery)?;
        }
        Ok(())
    }
}

fn rows(f: &mut fmt::Formatter<'_>, what: &str, changes: &EffectChanges) -> fmt::Result {
    writeln!(f, "    {what}:")?;
    for row in &changes.added {
        writeln!(f, "      + {row}")?;
    }
    for row in &changes.removed {
        writeln!(f, "      - {row}")?;
    }
    Ok(())
}

impl Harness {
    /// Checks that the consumers survive a crash between their handler and its commit: for
    /// every event due (as [`Harness::deliver`] would deliver them), it reads the effects,
    /// delivers the event and rolls the delivery back (a crash before the commit, as
    /// [`Harness::redeliver`]), reads them again, delivers the event again and commits, and
    /// reads them a third time.
    ///
    /// `effects_sql` is a query whose rows are the consumers' observable effects, e.g.
    /// `SELECT order_id, status FROM sent_mail`. Its rows are compared as text, in any order,
    /// counting duplicates, so leave out what differs between deliveries by design (a serial
    /// id, a timestamp) unless it is the effect. An event is a finding when the crashed
    /// delivery changed the effects *and* the redelivery changed them again: that consumer
    /// writes outside its delivery's transaction (a pool connection of its own, a call to
    /// another system) and looks idempotent only because the inbox never delivers a processed
    /// event twice; in production the crash happens anyway. A consumer that writes through
    /// [`Delivery::conn`](crate::Delivery::conn) leaves nothing behind, and one whose outside
    /// write is keyed changes nothing the second time: both pass.
    ///
    /// Ends as [`Harness::deliver`] does, with one committed delivery per event: a row whose
    /// redelivery succeeded is PROCESSED, one whose redelivery failed is marked for its retry
    /// (check it again once the clock has reached it). The effects query runs once before
    /// anything is delivered, so a query PostgreSQL refuses fails the check at once.
    ///
    /// # Errors
    /// [`Error::Config`] for a harness without a database ([`Harness::with_database`]);
    /// [`Error::Database`] or [`Error::Pool`] when the effects query fails. The events
    /// checked before the failure stay as they were delivered.
    pub async fn check_redelivery(&mut self, effects_sql: &str) -> Result<RedeliveryReport> {
        let pool = self.database.clone().ok_or_else(|| {
            Error::Config(
                "check_redelivery needs a database: build the harness with \
                 Harness::with_database"
                    .into(),
            )
        })?;
        let query = format!(
            "SELECT to_jsonb(t)::text AS row FROM ({}) t",
            effects_sql.trim().trim_end_matches(';')
        );
        let mut before = effects(&pool, &query).await?;
        let mut checks = Vec::new();
        for c in 0..self.consumers.len() {
            if self.consumers[c].paused {
                continue;
            }
            for i in self.due_rows(c) {
                self.ensure_handler(c);
                self.attempt(c, i, false).await;
                let crashed = effects(&pool, &query).await?;
                self.ensure_handler(c);
                let outcome = self.attempt(c, i, true).await;
                if outcome.handler_lost {
                    self.ensure_handler(c);
                }
                let after = effects(&pool, &query).await?;
                checks.push(RedeliveryCheck {
                    consumer: self.consumers[c].cfg.name.clone(),
                    event_id: outcome.event_id,
                    event_type: self.inbox[i].row.event_type.clone(),
                    crash: EffectChanges::between(&before, &crashed),
                    redelivery: EffectChanges::between(&crashed, &after),
                    outcome,
                });
                before = after;
            }
        }
        Ok(RedeliveryReport { checks })
    }
}

#[derive(QueryableByName)]
struct EffectRow {
    #[diesel(sql_type = Text)]
    row: String,
}

/// The effect rows now, as committed (each read on a connection of its own, outside any
/// delivery's transaction), sorted.
async fn effects(pool: &PgPool, query: &str) -> Result<Vec<String>> {
    let mut conn = pool.get().await?;
    let rows: Vec<EffectRow> = diesel::sql_query(query).load(&mut conn).await?;
    let mut rows: Vec<String> = rows.into_iter().map(|r| r.row).collect();
    rows.sort_unstable();
    Ok(rows)
}

/// The rows of sorted `a` that sorted `b` does not match one for one.
fn minus(a: &[String], b: &[String]) -> Vec<String> {
    let (mut out, mut j) = (Vec::new(), 0);
    for row in a {
        while j < b.len() && b[j] < *row {
            j += 1;
        }
        if j < b.len() && b[j] == *row {
            j += 1;
        } else {
            out.push(row.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(r: &[&str]) -> Vec<String> {
        r.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn effect_changes_count_duplicates() {
        let before = rows(&["a", "b", "b"]);
        let after = rows(&["a", "b", "b", "b", "c"]);
        let d = EffectChanges::between(&before, &after);
        assert_eq!(d.added, rows(&["b", "c"]));
        assert!(d.removed.is_empty());
        let back = EffectChanges::between(&after, &before);
        assert_eq!(back.removed, rows(&["b", "c"]));
        assert!(back.added.is_empty());
        assert!(EffectChanges::between(&before, &before).is_empty());
    }
}
