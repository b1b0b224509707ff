//! The NATS JetStream bridge (feature `nats`): services linked by a broker, with the same
//! guarantees as inside one database.
//!
//! - [`NatsTransport`] is an external [`Transport`](crate::transport::Transport): the
//!   publisher leases outbox rows, publishes each event to a JetStream stream, waits for the
//!   stream's acknowledgement and marks the row, fenced on its lease. The message id
//!   (`Nats-Msg-Id`) is the event id, so JetStream's duplicate window drops the re-publish
//!   that follows a crash between the publish and the mark.
//! - [`NatsReceiver`] is the receiving side, an actor the runtime supervises
//!   ([`OutboxBuilder::nats_receiver`](crate::OutboxBuilder::nats_receiver)): a durable pull
//!   consumer whose messages become inbox rows of this database, acknowledged only once the
//!   rows have committed.
//!
//! ## Why the receiver stores, acks, and lets the consumer engine run the handler
//!
//! Two designs keep "ack only after commit". (a) Run the handler in the transaction that
//! inserts the inbox row and, on failure, leave the message unacked and `nak` it with the
//! retry delay. (b) Insert the inbox row, commit, ack, and let the consumer engine (the same
//! one in-process events go through) run the handler from the row, with its retry policy,
//! dead letters and operator API. This bridge does (b), because it is the safer of the two:
//!
//! - A handler that kills its process is counted in the database by the engine's leases
//!   (`INBOX_ATTEMPT_INTERRUPTED`) and dead-lettered after its attempts. Under (a) the only
//!   count would be the broker's delivery count, which is outside the database and cannot be
//!   told apart from a receiver that died for another reason: a poison message would either
//!   loop or be dropped by `max_deliver` with nothing in the dead letters.
//! - A slow or failing consumer holds no broker message: nothing counts against
//!   `max_ack_pending`, so one consumer's failures do not stall the others behind it.
//! - Retries, backoff, pause, replay and dead letters are the engine's, already tested, and
//!   visible in the operator API like any other event's.
//!
//! The cost is one more commit per event (the inbox row, then the handler's effect with the
//! PROCESSED mark) and a wake-up between the two. The guarantees are unchanged: the row is
//! durable before the ack, so a crash before the ack means a redelivery that the inbox's
//! unique `(event_id, consumer)` absorbs (counted as `DUPLICATE_EVENT`), and the effect
//! commits with the PROCESSED mark, once.
//!
//! ## Wire format
//!
//! The body is the [`OutboxEvent`] as JSON (the receiver reads the body). The headers carry
//! the envelope too, for tools and for consumers that do not read the body: see the
//! `HEADER_*` constants. Header values are single-line: a line break in an aggregate id is
//! replaced by a space in its header (the body keeps it intact).

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};

use crate::error::{Error, Result};
use crate::event::OutboxEvent;

mod bindings;
mod receiver;
mod transport;

pub use receiver::{NatsHealth, NatsReceiver, NatsReceiverConfig, NatsStatus};
pub(crate) use receiver::{NatsReceiverActor, ReceiverDeps};
pub use transport::{NatsTransport, NatsTransportConfig};

/// The event type (header).
pub const HEADER_EVENT_TYPE: &str = "Outbox-Event-Type";
/// The payload's schema version.
pub const HEADER_EVENT_VERSION: &str = "Outbox-Event-Version";
/// The aggregate type.
pub const HEADER_AGGREGATE_TYPE: &str = "Outbox-Aggregate-Type";
/// The aggregate id.
pub const HEADER_AGGREGATE_ID: &str = "Outbox-Aggregate-Id";
/// The aggregate version, when the event has one.
pub const HEADER_AGGREGATE_VERSION: &str = "Outbox-Aggregate-Version";
/// The correlation id.
pub const HEADER_CORRELATION_ID: &str = "Outbox-Correlation-Id";
/// The causation id, when the event has one.
pub const HEADER_CAUSATION_ID: &str = "Outbox-Causation-Id";
/// When the producer's transaction wrote the event (RFC 3339).
pub const HEADER_CREATED_AT: &str = "Outbox-Created-At";
/// W3C trace context, copied from the event's metadata (`traceparent`, `tracestate`) when
/// there is one.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// See [`HEADER_TRACEPARENT`].
pub const HEADER_TRACESTATE: &str = "tracestate";

/// Connects to NATS the way the bridge expects: the first connection is retried in the
/// background (a service starts while NATS is down, and its events wait in the outbox), and
/// reconnections never give up.
///
/// # Errors
/// [`Error::Config`] for an address that cannot be parsed.
pub async fn connect(url: &str) -> Result<async_nats::Client> {
    async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((100u64 << attempts.min(5)).min(2_000))
        })
        .connect(url)
        .await
        .map_err(|e| Error::Config(format!("NATS at {url}: {e}")))
}

/// A JetStream stream's settings, shared by the publishing and the receiving side. Both
/// create the stream when it is missing and check it when it exists, so either service may
/// start first.
#[derive(Debug, Clone)]
pub struct NatsStream {
    pub(crate) name: String,
    pub(crate) subjects: Vec<String>,
    pub(crate) duplicate_window: Duration,
    pub(crate) storage: StorageType,
    pub(crate) retention: RetentionPolicy,
    pub(crate) max_age: Duration,
}

/// Setters, one per setting: start from [`NatsStream::new`] and chain them.
impl NatsStream {
    /// A stream named `name` (JetStream's rules: no spaces, `.`, `*` or `>`) holding the
    /// subjects `<name lowercased>.>`, with a 2 min duplicate window, file storage and the
    /// limits retention.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        NatsStream {
            subjects: vec![format!("{}.>", name.to_lowercase())],
            name,
            duplicate_window: Duration::from_secs(120),
            storage: StorageType::File,
            retention: RetentionPolicy::Limits,
            max_age: Duration::ZERO,
        }
    }

    /// The subjects the stream holds. Default `<name lowercased>.>`.
    pub fn subjects(mut self, subjects: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.subjects = subjects.into_iter().map(Into::into).collect();
        self
    }

    /// How long JetStream remembers a message id and drops a re-publish of it. A re-publish
    /// after a crash comes once the publisher's lease has expired, so keep it well above
    /// [`ExternalConfig::lease`](crate::transport::ExternalConfig::lease); later duplicates
    /// reach the receiving inbox, which absorbs them. Default 2 min.
    pub fn duplicate_window(mut self, duplicate_window: Duration) -> Self {
        self.duplicate_window = duplicate_window;
        self
    }

    /// File (survives a NATS restart) or memory. Default file.
    pub fn storage(mut self, storage: StorageType) -> Self {
        self.storage = storage;
        self
    }

    /// When JetStream deletes messages. Default limits (kept up to `max_age`); work-queue or
    /// interest retention delete a message once every consumer has acknowledged it.
    pub fn retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// How long messages are kept; zero keeps them for ever. Default zero. Keep it shorter
    /// than the receiving side's retention of processed inbox rows, or a very late redelivery
    /// is new again.
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn validate(&self) -> Result<()> {
        let bad_name = self.name.is_empty()
            || self
                .name
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'));
        if bad_name || self.subjects.is_empty() || self.duplicate_window.is_zero() {
            return Err(Error::Config(format!(
                "NATS stream {:?}: a valid name, at least one subject and a positive duplicate window are needed",
                self.name
            )));
        }
        Ok(())
    }

    fn to_config(&self) -> stream::Config {
        stream::Config {
            name: self.name.clone(),
            subjects: self.subjects.clone(),
            duplicate_window: self.duplicate_window,
            storage: self.storage,
            retention: self.retention,
            max_age: self.max_age,
            ..Default::default()
        }
    }

    /// Creates the stream, or checks the one that exists: a stream made with other settings
    /// is a configuration error, not something to change behind its owner's back.
    pub(crate) async fn ensure(&self, js: &async_nats::jetstream::Context) -> Result<()> {
        self.validate()?;
        let mut stream = js
            .get_or_create_stream(self.to_config())
            .await
            .map_err(|e| Error::Config(format!("NATS stream {}: {e}", self.name)))?;
        let info = stream
            .info()
            .await
            .map_err(|e| Error::Config(format!("NATS stream {}: {e}", self.name)))?;
        let have = &info.config;
        let mut differ = Vec::new();
        if have.duplicate_window != self.duplicate_window {
            differ.push(format!("duplicate window {:?}", have.duplicate_window));
        }
        if have.storage != self.storage {
            differ.push(format!("storage {:?}", have.storage));
        }
        if have.retention != self.retention {
            differ.push(format!("retention {:?}", have.retention));
        }
        if let Some(missing) = self.subjects.iter().find(|s| !have.subjects.contains(s)) {
            differ.push(format!("no subject {missing}"));
        }
        if differ.is_empty() {
            Ok(())
        } else {
            Err(Error::Config(format!(
                "NATS stream {} exists with other settings: {}",
                self.name,
                differ.join(", ")
            )))
        }
    }
}

/// Event type → subject: an explicit mapping first, else `<prefix>.<event type>`.
#[derive(Debug, Clone)]
pub(crate) struct Subjects {
    pub prefix: String,
    pub explicit: BTreeMap<String, String>,
}

impl Subjects {
    /// The subject of `event_type`, or why it cannot have one (a space or a wildcard in it).
    pub fn of(&self, event_type: &str) -> std::result::Result<String, String> {
        let subject = match self.explicit.get(event_type) {
            Some(s) => s.clone(),
            None => format!("{}.{event_type}", self.prefix),
        };
        let valid = !subject.is_empty()
            && !subject.starts_with('.')
            && !subject.ends_with('.')
            && !subject.contains("..")
            && !subject
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '*' | '>'));
        if valid {
            Ok(subject)
        } else {
            Err(format!(
                "event type {event_type:?} maps to {subject:?}, not a valid NATS subject"
            ))
        }
    }
}

/// A header value on one line.
fn one_line(v: &str) -> String {
    v.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// The headers of `event`'s message, `Nats-Msg-Id` included.
pub(crate) fn headers(event: &OutboxEvent) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    h.insert(
        async_nats::header::NATS_MESSAGE_ID,
        event.id.to_string().as_str(),
    );
    h.insert(HEADER_EVENT_TYPE, one_line(&event.event_type).as_str());
    h.insert(
        HEADER_EVENT_VERSION,
        event.event_version.to_string().as_str(),
    );
    h.insert(
        HEADER_AGGREGATE_TYPE,
        one_line(&event.aggregate_type).as_str(),
    );
    h.insert(HEADER_AGGREGATE_ID, one_line(&event.aggregate_id).as_str());
    if let Some(v) = event.aggregate_version {
        h.insert(HEADER_AGGREGATE_VERSION, v.to_string().as_str());
    }
    h.insert(
        HEADER_CORRELATION_ID,
        one_line(&event.correlation_id).as_str(),
    );
    if let Some(c) = &event.causation_id {
        h.insert(HEADER_CAUSATION_ID, one_line(c).as_str());
    }
    h.insert(HEADER_CREATED_AT, event.created_at.to_rfc3339().as_str());
    for (key, name) in [
        ("traceparent", HEADER_TRACEPARENT),
        ("tracestate", HEADER_TRACESTATE),
    ] {
        if let Some(v) = event.metadata.get(key).and_then(|v| v.as_str()) {
            h.insert(name, one_line(v).as_str());
        }
    }
    h
}

/// The event a message carries: its body, checked against its `Nats-Msg-Id`.
pub(crate) fn decode(
    body: &[u8],
    headers: Option<&async_nats::HeaderMap>,
) -> std::result::Result<OutboxEvent, String> {
    let event: OutboxEvent =
        serde_json::from_slice(body).map_err(|e| format!("body is not an outbox event: {e}"))?;
    let msg_id = headers
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_owned());
    match msg_id {
        Some(id) if id == event.id.to_string() => Ok(event),
        other => Err(format!(
            "Nats-Msg-Id {other:?} is not the body's event id {}",
            event.id
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(aggregate: &str) -> OutboxEvent {
        OutboxEvent {
            id: crate::event::EventId::new(),
            event_type: "ORDER_STATUS_CHANGED".into(),
            event_version: 2,
            aggregate_type: "order".into(),
            aggregate_id: aggregate.into(),
            aggregate_version: Some(3),
            payload: serde_json::json!({"status": "COMPLETED"}),
            metadata: serde_json::json!({"traceparent": "00-abc-def-01"}),
            correlation_id: "corr".into(),
            causation_id: None,
            created_at: chrono::Utc::now(),
            attempt: 1,
        }
    }

    #[test]
    fn an_event_survives_the_wire_and_its_headers_carry_the_envelope() {
        let e = event("o-1\nsecond line");
        let h = headers(&e);
        let body = serde_json::to_vec(&e).unwrap();
        assert_eq!(decode(&body, Some(&h)).unwrap(), e);
        assert_eq!(
            h.get(async_nats::header::NATS_MESSAGE_ID).unwrap().as_str(),
            e.id.to_string()
        );
        assert_eq!(
            h.get(HEADER_AGGREGATE_ID).unwrap().as_str(),
            "o-1 second line"
        );
        assert_eq!(h.get(HEADER_TRACEPARENT).unwrap().as_str(), "00-abc-def-01");
        assert_eq!(h.get(HEADER_EVENT_VERSION).unwrap().as_str(), "2");
        assert!(h.get(HEADER_CAUSATION_ID).is_none());
    }

    #[test]
    fn a_message_whose_id_is_not_its_bodys_is_refused() {
        let e = event("o-1");
        let body = serde_json::to_vec(&e).unwrap();
        let mut h = async_nats::HeaderMap::new();
        h.insert(async_nats::header::NATS_MESSAGE_ID, "other");
        assert!(decode(&body, Some(&h)).is_err());
        assert!(decode(&body, None).is_err());
        assert!(decode(b"{}", Some(&headers(&e))).is_err());
    }

    #[test]
    fn subjects_come_from_the_mapping_or_the_prefix_and_must_be_valid() {
        let s = Subjects {
            prefix: "orders".into(),
            explicit: [("ORDER_PLACED".to_owned(), "orders.placed".to_owned())].into(),
        };
        assert_eq!(s.of("ORDER_PLACED").unwrap(), "orders.placed");
        assert_eq!(
            s.of("ORDER_STATUS_CHANGED").unwrap(),
            "orders.ORDER_STATUS_CHANGED"
        );
        assert!(s.of("ORDER SHIPPED").is_err());
        assert!(s.of("ORDER.*").is_err());
        assert!(s.of("").is_err());
    }
}
