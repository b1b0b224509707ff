//! One delivery cycle of the harness: due rows handed to the real actor, and each outcome
//! marked as the runtime marks it.
use std::sync::Arc;

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::RwLock;

use crate::consumer::actor::HandlerRef;
use crate::consumer::decide::decide;
use crate::consumer::upcast;
use crate::consumer::{ConsumerConfig, Delivery, DeliveryMode};
use crate::error::{Error, ErrorCode, Result};
use crate::event::redact::Redactor;
use crate::event::EventId;
use crate::store::inbox::{error_text, truncate, Failure, InboxRow};

use super::database::Called;
use super::*;

impl Harness {
    pub(super) fn slot(&self, consumer: &str) -> Option<usize> {
        self.consumers
            .iter()
            .position(|c| c.cfg.name.as_str() == consumer)
    }

    pub(super) fn row_index(&self, c: usize, event_id: EventId) -> Option<usize> {
        let name = &self.consumers[c].cfg.name;
        self.inbox
            .iter()
            .position(|i| &i.consumer == name && i.row.event_id == event_id.as_uuid())
    }

    pub(super) fn set_paused(&mut self, consumer: &str, paused: bool) -> Result<()> {
        let c = self
            .slot(consumer)
            .ok_or_else(|| Error::UnknownConsumer(consumer.to_owned()))?;
        self.consumers[c].paused = paused;
        Ok(())
    }

    /// `claim_due` without the limit: the consumer's due rows by (`next_attempt_at`, `id`).
    pub(super) fn due_rows(&self, c: usize) -> Vec<usize> {
        let name = &self.consumers[c].cfg.name;
        let mut due: Vec<usize> = (0..self.inbox.len())
            .filter(|&i| {
                let e = &self.inbox[i];
                &e.consumer == name && e.status.claimable() && e.next_attempt_at <= self.now
            })
            .collect();
        due.sort_by_key(|&i| (self.inbox[i].next_attempt_at, self.inbox[i].row.id));
        due
    }

    /// What the runtime does before each delivery: a handler found stopped is replaced (the
    /// batch ends, the actor's next pump rebuilds it and claims the rest), so a handler that
    /// stopped itself after its last reply costs the next event no attempt.
    pub(super) fn ensure_handler(&mut self, c: usize) {
        let slot = &mut self.consumers[c];
        if !slot.handler.connected() {
            tracing::warn!(consumer = %slot.cfg.name, "handler actor stopped; starting a new one");
            slot.handler = (slot.factory)();
            slot.restarts += 1;
        }
    }

    /// One consumer's batch loop over `rows`. A lost handler ends the runtime's loop and the
    /// actor's next pump replaces the handler and claims the rest; here the rest follows at once.
    pub(super) async fn run_cycle(&mut self, c: usize, rows: Vec<usize>, out: &mut Vec<Outcome>) {
        for i in rows {
            self.ensure_handler(c);
            let outcome = self.attempt(c, i, true).await;
            if outcome.handler_lost {
                // The runtime's actor rebuilds at once after a lost handler, too.
                self.ensure_handler(c);
            }
            out.push(outcome);
        }
    }

    /// One row through the steps of `consumer::batch`: upcast, stale check, handler, mark.
    /// With `commit` false the attempt's marks are dropped, as a rolled-back transaction's are.
    pub(super) async fn attempt(&mut self, c: usize, i: usize, commit: bool) -> Outcome {
        let cfg = self.consumers[c].cfg.clone();
        let mut row = self.inbox[i].row.clone();
        let mut outcome = Outcome {
            consumer: cfg.name.clone(),
            event_id: EventId::from_uuid(row.event_id),
            attempt: (row.attempt_count + 1).max(1) as u32,
            result: Ok(()),
            status: self.inbox[i].status,
            handler_ran: false,
            handler_lost: false,
            rolled_back: !commit,
        };

        if let Err(err) = upcast(&cfg, &mut row) {
            if commit {
                self.mark_failed(i, decide(&cfg.retry, &row, &err));
            }
            outcome.result = Err(err);
            outcome.status = self.inbox[i].status;
            return outcome;
        }

        let aggregate = (row.aggregate_type.clone(), row.aggregate_id.clone());
        let version = row.aggregate_version.filter(|_| cfg.skip_stale);
        if let Some(version) = version {
            let current = self.consumers[c].versions.get(&aggregate).copied();
            if let Some(current) = current.filter(|&cur| cur > version) {
                if commit {
                    self.mark_stale(i, current);
                }
                outcome.status = self.inbox[i].status;
                return outcome;
            }
        }

        let handler = self.consumers[c].handler.clone();
        let called = match self.database.clone() {
            Some(pool) => super::database::call(&pool, &cfg, &handler, row.clone(), commit).await,
            None => without_database(&cfg, &handler, row.clone()).await,
        };
        outcome.handler_ran = called.ran;
        outcome.handler_lost = called.lost;
        let result = called.result;
        if commit {
            match &result {
                Ok(()) => {
                    if let Some(version) = version {
                        // Written in the handler's savepoint: kept only when the handler succeeded.
                        self.consumers[c].versions.insert(aggregate, version);
                    }
                    self.mark_processed(i);
                }
                Err(err) => self.mark_failed(i, decide(&cfg.retry, &row, err)),
            }
        }
        outcome.result = result;
        outcome.status = self.inbox[i].status;
        outcome
    }

    /// `store::inbox::mark_processed`.
    pub(super) fn mark_processed(&mut self, i: usize) {
        let e = &mut self.inbox[i];
        e.status = InboxStatus::Processed;
        e.row.attempt_count += 1;
        e.error_code = None;
        e.last_error = None;
    }

    /// `store::inbox::mark_stale`.
    pub(super) fn mark_stale(&mut self, i: usize, current: i64) {
        let e = &mut self.inbox[i];
        e.status = InboxStatus::Processed;
        e.row.attempt_count += 1;
        e.error_code = Some("EVENT_STALE".to_owned());
        e.last_error = Some(format!(
            "stale: the consumer already applied aggregate version {current}"
        ));
    }

    /// `Settle::Failed` of `store::inbox::settle`; the harness has one attempt in flight at a
    /// time, so it needs no lease to fence on.
    pub(super) fn mark_failed(&mut self, i: usize, f: Failure) {
        let now = self.now;
        let e = &mut self.inbox[i];
        if !e.status.claimable() {
            return;
        }
        e.row.attempt_count += 1;
        e.status = if f.dead {
            InboxStatus::DeadLetter
        } else {
            InboxStatus::RetryPending
        };
        let delay = TimeDelta::try_milliseconds(f.delay_ms).unwrap_or(TimeDelta::MAX);
        e.next_attempt_at = now
            .checked_add_signed(delay)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        e.error_code = Some(truncate(&f.code, 200));
        // The runtime's default: a harness has no `RuntimeConfig`.
        e.last_error = Some(error_text(&Redactor::default(), &f.message));
    }
}

/// Calls the handler with a delivery that has no connection: `Delivery::conn` reports the
/// delivery as finished.
async fn without_database(cfg: &ConsumerConfig, handler: &HandlerRef, row: InboxRow) -> Called {
    let slot = Arc::new(RwLock::new(None));
    let delivery = Delivery {
        row,
        consumer: cfg.name.clone(),
        slot: slot.clone(),
        events: cfg.events.clone(),
        mode: DeliveryMode::Live,
        span: tracing::Span::none(),
    };
    let (result, lost, _) = crate::consumer::call(cfg, handler, vec![delivery], &slot).await;
    Called {
        result,
        lost,
        ran: true,
    }
}

pub(super) fn view(e: &InboxEntry) -> InboxView {
    InboxView {
        event_id: EventId::from_uuid(e.row.event_id),
        event_type: e.row.event_type.clone(),
        status: e.status,
        attempts: e.row.attempt_count.max(0) as u32,
        error_code: e.error_code.clone().map(ErrorCode::new),
        last_error: e.last_error.clone(),
        next_attempt_at: e.next_attempt_at,
    }
}

/// The error PostgreSQL's unique constraint gives a second event with the same id.
pub(super) fn unique_violation(message: String) -> Error {
    use diesel::result::{DatabaseErrorKind, Error as D};
    Error::Database(D::DatabaseError(
        DatabaseErrorKind::UniqueViolation,
        Box::new(message),
    ))
}
