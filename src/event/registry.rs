//! Typed events and the registry that validates them at enqueue and upgrades old versions
//! before delivery.

use std::collections::HashMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::{normalize_keys, NewEvent, PayloadRules};
use crate::error::{Error, Result};

/// A typed event: a fact in the past tense about one aggregate.
///
/// ```
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct OrderStatusChanged { order_id: String, status: String, version: i64 }
///
/// impl actix_outbox::Event for OrderStatusChanged {
///     const TYPE: &'static str = "ORDER_STATUS_CHANGED";
///     const VERSION: i32 = 2;
///     const AGGREGATE_TYPE: &'static str = "order";
///     fn aggregate_id(&self) -> String { self.order_id.clone() }
///     fn aggregate_version(&self) -> Option<i64> { Some(self.version) }
/// }
/// ```
///
/// Events are not commands: `SEND_NOTIFICATION` names a job for one worker and belongs in a job
/// table; `ORDER_STATUS_CHANGED` says what happened, and any number of consumers may react.
pub trait Event: Serialize + DeserializeOwned {
    /// The event type, e.g. `ORDER_STATUS_CHANGED`.
    const TYPE: &'static str;
    /// The payload's current schema version.
    const VERSION: i32 = 1;
    /// The aggregate type, e.g. `order`.
    const AGGREGATE_TYPE: &'static str;
    /// The aggregate id.
    fn aggregate_id(&self) -> String;
    /// The aggregate's version after the change, for stale-event detection.
    fn aggregate_version(&self) -> Option<i64> {
        None
    }
}

type Check = fn(&Value) -> std::result::Result<(), String>;
type Upcaster = Arc<dyn Fn(Value) -> std::result::Result<Value, String> + Send + Sync>;

/// The event types an application writes and reads, with their current versions and the
/// upcasters that lift older payloads still in the tables to the current shape.
///
/// Enqueue through [`EventRegistry::enqueue`] to have the type, version and payload checked
/// at runtime (not only by the Rust type): a failure is `EVENT_SCHEMA_INVALID` and fails the
/// caller's transaction. Give the registry to the runtime
/// ([`OutboxBuilder::events`](crate::OutboxBuilder::events)) to have deliveries upcast; an
/// older version no upcaster lifts is dead-lettered at once with `EVENT_VERSION_UNSUPPORTED`.
/// A version newer than this build's fails with the same code but is retried on the
/// consumer's policy: during a rolling deploy an instance of the newer build can handle it,
/// and an old instance claiming it first does not dead-letter it.
#[derive(Clone, Default)]
pub struct EventRegistry {
    types: HashMap<String, (i32, Check)>,
    /// (type, from version) → the step to from + 1.
    upcasters: HashMap<(String, i32), Upcaster>,
    rules: PayloadRules,
}

impl std::fmt::Debug for EventRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventRegistry")
            .field(
                "types",
                &self
                    .types
                    .iter()
                    .map(|(t, (v, _))| (t, v))
                    .collect::<Vec<_>>(),
            )
            .field("upcasters", &self.upcasters.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// What the registry made of a stored event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Upcast {
    /// The type is not registered: delivered as stored.
    Unregistered,
    /// Now at the current version, with this payload.
    Current(i32, Value),
    /// No code can read this version.
    Unsupported(String),
    /// A version newer than this build reads: a newer build may.
    Newer(String),
    /// An upcaster or the current type rejected the payload.
    Invalid(String),
}

fn check<E: Event>(v: &Value) -> std::result::Result<(), String> {
    E::deserialize(v).map(|_| ()).map_err(|e| e.to_string())
}

impl EventRegistry {
    /// An empty registry with the default payload rules (64 KiB, no secret-looking keys).
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `E` at its current [`Event::VERSION`].
    pub fn register<E: Event>(mut self) -> Self {
        self.types
            .insert(E::TYPE.to_owned(), (E::VERSION, check::<E>));
        self
    }

    /// Registers the step that turns a `from`-version payload of `event_type` into a
    /// `from + 1` one. Chains run step by step up to the current version.
    pub fn upcaster(
        mut self,
        event_type: &str,
        from: i32,
        step: impl Fn(Value) -> std::result::Result<Value, String> + Send + Sync + 'static,
    ) -> Self {
        self.upcasters
            .insert((event_type.to_owned(), from), Arc::new(step));
        self
    }

    /// Replaces the keys rejected in payloads and metadata (default
    /// [`DEFAULT_SENSITIVE_KEYS`](crate::event::DEFAULT_SENSITIVE_KEYS), which says how a key
    /// matches: by whole words, so `credit_card` catches `creditCard` but not `credit_cards`).
    pub fn sensitive_keys(mut self, keys: &[&str]) -> Self {
        self.rules.sensitive_keys = normalize_keys(keys);
        self
    }

    /// The largest payload accepted, in bytes of JSON (default 64 KiB).
    pub fn max_payload_bytes(mut self, n: usize) -> Self {
        self.rules.max_payload_bytes = n;
        self
    }

    /// Checks an event as [`EventRegistry::enqueue`] would, without writing it.
    ///
    /// # Errors
    /// [`Error::InvalidEvent`] (`EVENT_SCHEMA_INVALID`): malformed envelope, oversized or
    /// secret-looking payload, unknown type, a version other than the current one, or a
    /// payload that does not deserialize into the registered type.
    pub fn validate(&self, event: &NewEvent) -> Result<()> {
        event.validate(&self.rules)?;
        let bad = |why: String| {
            Err(Error::InvalidEvent(format!(
                "{} {}: {why}",
                event.event_type, event.id
            )))
        };
        let Some((current, check)) = self.types.get(&event.event_type) else {
            return bad("unknown event type; register it first".into());
        };
        if event.event_version != *current {
            return bad(format!(
                "version {} is not the current version {current}",
                event.event_version
            ));
        }
        if let Err(e) = check(&event.payload) {
            return bad(format!("payload does not match the registered type: {e}"));
        }
        Ok(())
    }

    /// [`EventRegistry::validate`] for an event of a registered type; for another, only the
    /// envelope and payload rules. A runtime's registry may list only the types its consumers
    /// read, and a handler's follow-up of another type was never refused for that.
    pub(crate) fn validate_follow_up(&self, event: &NewEvent) -> Result<()> {
        if self.types.contains_key(&event.event_type) {
            self.validate(event)
        } else {
            event.validate(&self.rules)
        }
    }

    /// Lifts a stored payload to the current version of its type.
    /// Whether `event_type` is registered.
    pub(crate) fn registers(&self, event_type: &str) -> bool {
        self.types.contains_key(event_type)
    }

    /// Why a stored `version` of a registered `event_type` cannot be lifted to the current one
    /// (a missing upcaster step), or `None` if it can, is current, is newer (a newer build's
    /// events, during a rolling deploy), or the type is not registered.
    pub(crate) fn unliftable(&self, event_type: &str, version: i32) -> Option<String> {
        let (current, _) = self.types.get(event_type)?;
        (version..*current)
            .find(|from| !self.upcasters.contains_key(&(event_type.to_owned(), *from)))
            .map(|from| format!("{event_type} v{from} has no upcaster to v{}", from + 1))
    }

    pub(crate) fn upcast(&self, event_type: &str, version: i32, payload: &Value) -> Upcast {
        let Some((current, check)) = self.types.get(event_type) else {
            return Upcast::Unregistered;
        };
        if version > *current {
            return Upcast::Newer(format!(
                "{event_type} v{version} is newer than v{current}, the newest this build reads"
            ));
        }
        let mut payload = payload.clone();
        for from in version..*current {
            let Some(step) = self.upcasters.get(&(event_type.to_owned(), from)) else {
                return Upcast::Unsupported(format!(
                    "{event_type} v{from} has no upcaster to v{}",
                    from + 1
                ));
            };
            payload = match step(payload) {
                Ok(p) => p,
                Err(e) => return Upcast::Invalid(format!("upcasting {event_type} v{from}: {e}")),
            };
        }
        match check(&payload) {
            Ok(()) => Upcast::Current(*current, payload),
            Err(e) => Upcast::Invalid(format!(
                "{event_type} v{current} payload does not decode: {e}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Serialize, Deserialize)]
    struct Changed {
        order_id: String,
        status: String,
    }
    impl Event for Changed {
        const TYPE: &'static str = "CHANGED";
        const VERSION: i32 = 3;
        const AGGREGATE_TYPE: &'static str = "order";
        fn aggregate_id(&self) -> String {
            self.order_id.clone()
        }
    }

    fn registry() -> EventRegistry {
        EventRegistry::new()
            .register::<Changed>()
            .upcaster("CHANGED", 1, |mut v| {
                v["status"] = v["state"].take();
                Ok(v)
            })
            .upcaster("CHANGED", 2, Ok)
    }

    #[test]
    fn old_versions_are_lifted_step_by_step_and_unknown_ones_are_unsupported_or_newer() {
        let r = registry();
        let v1 = json!({"order_id": "o1", "state": "PAID"});
        assert_eq!(
            r.upcast("CHANGED", 1, &v1),
            Upcast::Current(
                3,
                json!({"order_id": "o1", "state": null, "status": "PAID"})
            )
        );
        assert!(matches!(r.upcast("CHANGED", 4, &v1), Upcast::Newer(_)));
        assert!(matches!(
            r.upcast("CHANGED", 0, &v1),
            Upcast::Unsupported(_)
        ));
        assert!(matches!(
            r.upcast("CHANGED", 3, &json!({"order_id": 1})),
            Upcast::Invalid(_)
        ));
        assert_eq!(r.upcast("OTHER", 9, &v1), Upcast::Unregistered);
    }

    #[test]
    fn validation_rejects_unknown_types_other_versions_and_bad_payloads() {
        let r = registry();
        let ok = NewEvent::typed(&Changed {
            order_id: "o1".into(),
            status: "PAID".into(),
        })
        .unwrap();
        assert!(r.validate(&ok).is_ok());
        for bad in [
            NewEvent::new("NOPE", "order", "o1", json!({})),
            ok.clone().version(2),
            NewEvent::new("CHANGED", "order", "o1", json!({"order_id": "o1"})).version(3),
            NewEvent::new(
                "CHANGED",
                "order",
                "o1",
                json!({"order_id": "o1", "status": "x", "token": "t"}),
            )
            .version(3),
        ] {
            assert_eq!(
                r.validate(&bad).unwrap_err().code().as_str(),
                "EVENT_SCHEMA_INVALID"
            );
        }
        let lenient = r.clone().sensitive_keys(&[]);
        let with_token = NewEvent::new(
            "CHANGED",
            "order",
            "o1",
            json!({"order_id": "o1", "status": "x", "token": "t"}),
        )
        .version(3);
        assert!(lenient.validate(&with_token).is_ok());
    }
}
