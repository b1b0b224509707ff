//! `NatsTransport`: the publishing side of the bridge.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;

use super::{NatsStream, Subjects};
use crate::error::{Error, ErrorCode, Result};
use crate::event::OutboxEvent;
use crate::messages::BoxFuture;
use crate::publisher::{Transport, TransportError};

/// How [`NatsTransport`] publishes.
#[derive(Debug, Clone)]
pub struct NatsTransportConfig {
    pub(crate) stream: NatsStream,
    pub(crate) subject_prefix: Option<String>,
    pub(crate) subjects: BTreeMap<String, String>,
    pub(crate) ack_timeout: Duration,
    pub(crate) start_timeout: Duration,
}

/// Setters, one per setting: start from [`NatsTransportConfig::new`] and chain them.
impl NatsTransportConfig {
    /// Publishes to `stream`, created or checked at start.
    pub fn new(stream: NatsStream) -> Self {
        NatsTransportConfig {
            stream,
            subject_prefix: None,
            subjects: BTreeMap::new(),
            ack_timeout: Duration::from_secs(5),
            start_timeout: Duration::from_secs(2),
        }
    }

    /// Subjects of event types without an explicit [`subject`](Self::subject) are
    /// `<subject_prefix>.<event type>`. Default: the stream's name lowercased, which the
    /// stream's default subjects hold.
    pub fn subject_prefix(mut self, subject_prefix: impl Into<String>) -> Self {
        self.subject_prefix = Some(subject_prefix.into());
        self
    }

    /// Publishes events of `event_type` to `subject` (which the stream must hold).
    pub fn subject(mut self, event_type: impl Into<String>, subject: impl Into<String>) -> Self {
        self.subjects.insert(event_type.into(), subject.into());
        self
    }

    /// How long to wait for the stream's acknowledgement; past it the publish fails with
    /// `OUTBOX_PUBLISH_TIMEOUT` and is retried (with the same message id, so a message the
    /// stream did store is dropped as a duplicate). Keep it below
    /// [`ExternalConfig::publish_timeout`](crate::transport::ExternalConfig::publish_timeout).
    /// Default 5 s.
    pub fn ack_timeout(mut self, ack_timeout: Duration) -> Self {
        self.ack_timeout = ack_timeout;
        self
    }

    /// How long [`NatsTransport::new`] tries to create or check the stream. Past it (NATS is
    /// down) the transport starts anyway and checks the stream before its first publish;
    /// events wait in the outbox meanwhile. Default 2 s.
    pub fn start_timeout(mut self, start_timeout: Duration) -> Self {
        self.start_timeout = start_timeout;
        self
    }
}

/// Publishes outbox events to a JetStream stream and waits for the stream's acknowledgement.
/// Give it to [`OutboxBuilder::external_transport`](crate::OutboxBuilder::external_transport).
///
/// Every publish carries the event id as `Nats-Msg-Id`, so a re-publish inside the stream's
/// duplicate window (after a crash between the publish and the mark) is acknowledged without
/// a second message; later, the receiving inbox absorbs it.
#[derive(Clone)]
pub struct NatsTransport {
    js: async_nats::jetstream::Context,
    stream: NatsStream,
    subjects: Subjects,
    /// The stream was created or checked. Until then (NATS was down at start), every publish
    /// checks it first.
    ensured: Arc<AtomicBool>,
}

impl NatsTransport {
    /// A transport on `client` (see [`connect`](super::connect)). Creates or checks the stream
    /// when NATS answers within [`NatsTransportConfig::start_timeout`]; when it does not, the
    /// check is made before the first publish.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid settings, or a stream that exists with other settings.
    pub async fn new(client: async_nats::Client, config: NatsTransportConfig) -> Result<Self> {
        config.stream.validate()?;
        if config.ack_timeout.is_zero() {
            return Err(Error::Config("NATS ack_timeout must be positive".into()));
        }
        let mut js = async_nats::jetstream::new(client);
        js.set_timeout(config.ack_timeout);
        let subjects = Subjects {
            prefix: config
                .subject_prefix
                .clone()
                .unwrap_or_else(|| config.stream.name.to_lowercase()),
            explicit: config.subjects.clone(),
        };
        let transport = NatsTransport {
            js,
            stream: config.stream,
            subjects,
            ensured: Arc::new(AtomicBool::new(false)),
        };
        match tokio::time::timeout(config.start_timeout, transport.stream.ensure(&transport.js))
            .await
        {
            Ok(Ok(())) => transport.ensured.store(true, Ordering::Relaxed),
            Ok(Err(e)) if transport.js_reachable() => return Err(e),
            Ok(Err(e)) => {
                tracing::warn!(stream = %transport.stream.name, error = %e,
                    "NATS unreachable at start: the stream is checked before the first publish")
            }
            Err(_) => tracing::warn!(stream = %transport.stream.name,
                "NATS unreachable at start: the stream is checked before the first publish"),
        }
        Ok(transport)
    }

    fn js_reachable(&self) -> bool {
        self.js.client().connection_state() == async_nats::connection::State::Connected
    }

    /// The subject `event_type` is published to.
    ///
    /// # Errors
    /// [`Error::InvalidEvent`] when the mapping makes an invalid subject of it.
    pub fn subject_of(&self, event_type: &str) -> Result<String> {
        self.subjects.of(event_type).map_err(Error::InvalidEvent)
    }

    async fn publish_event(&self, event: &OutboxEvent) -> std::result::Result<(), TransportError> {
        let subject =
            self.subjects
                .of(&event.event_type)
                .map_err(|message| TransportError::Permanent {
                    code: ErrorCode::EVENT_SCHEMA_INVALID,
                    message,
                })?;
        if !self.ensured.load(Ordering::Relaxed) {
            self.stream
                .ensure(&self.js)
                .await
                .map_err(|e| TransportError::Retryable(e.to_string()))?;
            self.ensured.store(true, Ordering::Relaxed);
        }
        let body = serde_json::to_vec(event).map_err(|e| TransportError::Permanent {
            code: ErrorCode::EVENT_SCHEMA_INVALID,
            message: e.to_string(),
        })?;
        let publish = PublishMessage::build()
            .payload(body.into())
            .headers(super::headers(event));
        let ack = self
            .js
            .send_publish(subject, publish)
            .await
            .map_err(|e| self.refused(e))?;
        let ack = ack.await.map_err(|e| self.refused(e))?;
        if ack.duplicate {
            tracing::debug!(event_id = %event.id, stream = %ack.stream,
                "already in the stream: JetStream dropped the re-publish");
        }
        Ok(())
    }

    /// A publish the stream did not confirm: a timeout keeps its own code; a message too large
    /// for the server never fits; anything else may pass later.
    fn refused(&self, e: async_nats::jetstream::context::PublishError) -> TransportError {
        match e.kind() {
            PublishErrorKind::TimedOut => TransportError::Timeout(e.to_string()),
            PublishErrorKind::MaxPayloadExceeded => TransportError::Permanent {
                code: ErrorCode::OUTBOX_PUBLISH_FAILED,
                message: e.to_string(),
            },
            PublishErrorKind::StreamNotFound => {
                // Deleted under us: made again before the next publish.
                self.ensured.store(false, Ordering::Relaxed);
                TransportError::Retryable(e.to_string())
            }
            _ => TransportError::Retryable(e.to_string()),
        }
    }
}

impl Transport for NatsTransport {
    fn publish<'a>(
        &'a self,
        event: &'a OutboxEvent,
    ) -> BoxFuture<'a, std::result::Result<(), TransportError>> {
        Box::pin(self.publish_event(event))
    }
}
