//! The event envelope: ids, the event a producer writes, and the checks made before it is.

use serde::{Deserialize, Serialize};
use std::fmt;
use uuid::Uuid;

use crate::error::{Error, Result};

mod published;
pub(crate) mod redact;
mod registry;

pub use published::OutboxEvent;
pub(crate) use registry::Upcast;
pub use registry::{Event, EventRegistry};

/// The id of one logical event. Made once by the producer (UUID v7) and kept through every
/// retry, transport and consumer, so it is the key the inbox deduplicates on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EventId(Uuid);

impl EventId {
    /// A new time-ordered id.
    pub fn new() -> Self {
        EventId(Uuid::now_v7())
    }

    /// Wraps an id read from elsewhere (a broker header, an operator's request).
    pub fn from_uuid(id: Uuid) -> Self {
        EventId(id)
    }

    /// The underlying UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The name of a consumer, e.g. `notification`. It keys the consumer's inbox rows, pause switch
/// and subscriptions, so renaming a consumer starts it with an empty inbox.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ConsumerName(String);

impl ConsumerName {
    /// Validates and wraps a consumer name: 1–100 characters of `[A-Za-z0-9_.-]`.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let valid = !name.is_empty()
            && name.len() <= 100
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if valid {
            Ok(ConsumerName(name))
        } else {
            Err(Error::Config(format!(
                "consumer name {name:?} must be 1-100 characters of letters, digits, '_', '-' or '.'"
            )))
        }
    }

    /// The name as stored in the database.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `name` as given, to be checked later ([`ConsumerConfig`](crate::ConsumerConfig) checks
    /// its name with every other setting, at start).
    pub(crate) fn unchecked(name: &str) -> Self {
        ConsumerName(name.to_owned())
    }
}

impl fmt::Display for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The largest payload accepted at enqueue, in bytes of JSON. Events carry ids, not documents.
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024;

/// An event about to be written to the outbox in the caller's transaction.
///
/// The name is a fact in the past tense (`ORDER_STATUS_CHANGED`), not a command
/// (`SEND_NOTIFICATION`): an event says what happened and any number of consumers may react;
/// a command is one job for one worker and belongs in a job table of its own.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub(crate) id: EventId,
    pub(crate) event_type: String,
    pub(crate) event_version: i32,
    pub(crate) aggregate_type: String,
    pub(crate) aggregate_id: String,
    pub(crate) aggregate_version: Option<i64>,
    pub(crate) payload: serde_json::Value,
    pub(crate) metadata: serde_json::Value,
    pub(crate) correlation_id: Option<String>,
    pub(crate) causation_id: Option<String>,
}

impl NewEvent {
    /// An event of `event_type` (version 1) about the aggregate `aggregate_type`/`aggregate_id`.
    pub fn new(
        event_type: impl Into<String>,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        NewEvent {
            id: EventId::new(),
            event_type: event_type.into(),
            event_version: 1,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            aggregate_version: None,
            payload,
            metadata: serde_json::Value::Object(Default::default()),
            correlation_id: None,
            causation_id: None,
        }
    }

    /// Uses a caller-made id instead of a fresh one (e.g. to make enqueue itself idempotent).
    pub fn with_id(mut self, id: EventId) -> Self {
        self.id = id;
        self
    }

    /// The schema version of the payload (default 1).
    pub fn version(mut self, version: i32) -> Self {
        self.event_version = version;
        self
    }

    /// The aggregate's version after the change, for stale-event detection by consumers.
    pub fn aggregate_version(mut self, version: i64) -> Self {
        self.aggregate_version = Some(version);
        self
    }

    /// The id shared by everything one request caused. A fresh one is made when none is set.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// The id of what directly caused this event (usually another event's id).
    pub fn causation_id(mut self, id: impl Into<String>) -> Self {
        self.causation_id = Some(id.into());
        self
    }

    /// Free-form metadata such as a W3C `traceparent`; never personal data.
    pub fn metadata(mut self, metadata: serde_json::Value) -> Self {
        self.metadata = metadata;
        self
    }

    /// The id this event will have.
    pub fn id(&self) -> EventId {
        self.id
    }

    /// An event from a typed value: type, version and aggregate come from [`Event`].
    ///
    /// # Errors
    /// [`Error::InvalidEvent`] when the value does not serialize.
    pub fn typed<E: Event>(event: &E) -> Result<Self> {
        let payload = serde_json::to_value(event)
            .map_err(|e| Error::InvalidEvent(format!("{} does not serialize: {e}", E::TYPE)))?;
        let mut new = NewEvent::new(E::TYPE, E::AGGREGATE_TYPE, event.aggregate_id(), payload)
            .version(E::VERSION);
        new.aggregate_version = event.aggregate_version();
        Ok(new)
    }

    /// Rejects what must never reach the table. Runs before any write, so a rejected event
    /// fails the caller's transaction instead of failing every consumer later.
    pub(crate) fn validate(&self, rules: &PayloadRules) -> Result<()> {
        let bad = |why: String| {
            Err(Error::InvalidEvent(format!(
                "{} {}: {why}",
                self.event_type, self.id
            )))
        };
        if self.event_type.is_empty() || self.event_type.len() > 200 {
            return bad("event type must be 1-200 characters".into());
        }
        if self.event_version < 1 {
            return bad(format!("version {} must be at least 1", self.event_version));
        }
        if self.aggregate_type.is_empty() || self.aggregate_id.is_empty() {
            return bad("aggregate type and id must not be empty".into());
        }
        // Past these, an index entry would outgrow PostgreSQL's limit for one B-tree row.
        let ids = [
            ("aggregate type", Some(&self.aggregate_type), 200),
            ("aggregate id", Some(&self.aggregate_id), 400),
            ("correlation id", self.correlation_id.as_ref(), 400),
            ("causation id", self.causation_id.as_ref(), 400),
        ];
        for (what, value, max) in ids {
            if value.is_some_and(|v| v.chars().count() > max) {
                return bad(format!("{what} must be at most {max} characters"));
            }
        }
        // PostgreSQL's text and jsonb cannot hold NUL; refused there, the error would say
        // DATABASE_ERROR instead of naming the field.
        let texts = [
            ("event type", Some(&self.event_type)),
            ("aggregate type", Some(&self.aggregate_type)),
            ("aggregate id", Some(&self.aggregate_id)),
            ("correlation id", self.correlation_id.as_ref()),
            ("causation id", self.causation_id.as_ref()),
        ];
        for (what, value) in texts {
            if value.is_some_and(|v| v.contains('\0')) {
                return bad(format!("{what} contains a NUL character"));
            }
        }
        if has_nul(&self.payload) || has_nul(&self.metadata) {
            return bad("payload or metadata contains a NUL character (\\u0000)".into());
        }
        if let Some(v) = self.aggregate_version {
            if v < 0 {
                return bad(format!("aggregate version {v} must not be negative"));
            }
        }
        if !self.metadata.is_object() {
            return bad("metadata must be a JSON object".into());
        }
        let size = serde_json::to_vec(&self.payload)
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        if size > rules.max_payload_bytes {
            return bad(format!(
                "payload is {size} bytes, the limit is {}",
                rules.max_payload_bytes
            ));
        }
        // Metadata is stored and shipped with the payload, so a secret there leaks the same way.
        for (root, value) in [("payload", &self.payload), ("metadata", &self.metadata)] {
            if let Some(path) = rules.find_sensitive(value, root) {
                return bad(format!(
                    "key {path} looks like a secret or personal data; carry an id instead"
                ));
            }
        }
        Ok(())
    }
}

/// Whether a string or key anywhere in `v` holds a NUL, which `jsonb` refuses.
fn has_nul(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(a) => a.iter().any(has_nul),
        serde_json::Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

/// What any payload must satisfy, checked at enqueue.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PayloadRules {
    pub max_payload_bytes: usize,
    /// Each sensitive key's words written together, lower case ([`normalize_key`]): a key is
    /// rejected when a contiguous run of its own words spells one of these.
    pub sensitive_keys: Vec<String>,
}

/// Keys rejected by default, in the payload and in the metadata: events carry ids, never
/// secrets or personal data.
///
/// A key is split into words (on `_`, `-`, `.`, any other character that is not a letter or a
/// digit, camelCase humps and letter/digit changes) and lower-cased. A sensitive key matches
/// when its own words appear as a contiguous run of the key's words, or the same letters run
/// together (`apikey`): `password` catches `password`, `userPassword` and `password_hash`;
/// `api_key` catches `api_key`, `X-Api-Key` and `apikey`; `token` catches `access_token`.
/// Whole words, not fragments, so that an id or a count that merely contains a sensitive
/// word goes through: `payment_authorization_id`, `tokens_used` (a plural is another word).
/// For the same reason `authorization` is not on the list: in a payments event the word names
/// a business fact. Compounds such as `access_token` are listed for their spelling without
/// separators (`accesstoken`), which no shorter entry catches.
///
/// The plain [`enqueue`](crate::enqueue) and the test harness always use this list;
/// [`EventRegistry::sensitive_keys`] replaces it for a registry's enqueues. The default
/// redaction of stored error text ([`default_redactor`](crate::redact::default_redactor))
/// blanks the values of `key=value` pairs by the same list and matching.
pub const DEFAULT_SENSITIVE_KEYS: &[&str] = &[
    "password",
    "passwd",
    "passphrase",
    "secret",
    "client_secret",
    "private_key",
    "credentials",
    "token",
    "access_token",
    "refresh_token",
    "api_key",
    "card_number",
    "cvv",
    "email",
    "email_address",
    "phone",
    "phone_number",
];

impl Default for PayloadRules {
    fn default() -> Self {
        PayloadRules {
            max_payload_bytes: MAX_PAYLOAD_BYTES,
            sensitive_keys: normalize_keys(DEFAULT_SENSITIVE_KEYS),
        }
    }
}

/// The lower-case words of a key: split on every character that is not a letter or a digit,
/// before an upper-case letter that follows a lower-case one or a digit (`userPassword`),
/// before the last capital of a run followed by a lower-case letter (`APIKey` → `api`,
/// `key`), and where letters and digits meet (`email2`).
fn key_words(key: &str) -> Vec<String> {
    let chars: Vec<char> = key.chars().collect();
    let mut words = Vec::new();
    let mut word = String::new();
    for (i, &c) in chars.iter().enumerate() {
        if !c.is_alphanumeric() {
            if !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            continue;
        }
        if let Some(&prev) = i.checked_sub(1).and_then(|p| chars.get(p)) {
            let next = chars.get(i + 1).copied();
            let hump = c.is_uppercase() && (prev.is_lowercase() || prev.is_numeric());
            let acronym_end =
                c.is_uppercase() && prev.is_uppercase() && next.is_some_and(|n| n.is_lowercase());
            let digits = prev.is_alphanumeric() && (prev.is_numeric() != c.is_numeric());
            if (hump || acronym_end || digits) && !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
        }
        word.extend(c.to_lowercase());
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

/// A sensitive key as [`PayloadRules::sensitive_keys`] holds it: its words written together.
fn normalize_key(key: &str) -> String {
    key_words(key).concat()
}

/// [`normalize_key`] for a list, leaving out keys with no letter or digit (they would match
/// nothing, or everything).
pub(crate) fn normalize_keys(keys: &[&str]) -> Vec<String> {
    keys.iter()
        .map(|k| normalize_key(k))
        .filter(|k| !k.is_empty())
        .collect()
}

/// Whether a contiguous run of `words` written together is `sensitive`.
fn spells(words: &[String], sensitive: &str) -> bool {
    (0..words.len()).any(|start| {
        let mut run = String::new();
        for w in &words[start..] {
            run.push_str(w);
            if !sensitive.starts_with(run.as_str()) {
                return false;
            }
            if run.len() == sensitive.len() {
                return true;
            }
        }
        false
    })
}

impl PayloadRules {
    /// Whether `key` has a sensitive key among its words.
    fn is_sensitive(&self, key: &str) -> bool {
        let words = key_words(key);
        self.sensitive_keys.iter().any(|s| spells(&words, s))
    }

    /// The path, from `root` (`payload`, `metadata`), of the first object key at any depth
    /// that looks sensitive, e.g. `payload.items[0].apiKey`.
    fn find_sensitive(&self, value: &serde_json::Value, root: &str) -> Option<String> {
        self.sensitive_below(value)
            .map(|rest| format!("{root}{rest}"))
    }

    /// [`PayloadRules::find_sensitive`]'s path below `value`; built on the way back up, so
    /// that a clean event (every event, nearly) costs no path strings.
    fn sensitive_below(&self, value: &serde_json::Value) -> Option<String> {
        match value {
            serde_json::Value::Object(map) => map.iter().find_map(|(k, v)| {
                if self.is_sensitive(k) {
                    Some(format!(".{k}"))
                } else {
                    self.sensitive_below(v).map(|rest| format!(".{k}{rest}"))
                }
            }),
            serde_json::Value::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, v)| self.sensitive_below(v).map(|rest| format!("[{i}]{rest}"))),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(payload: serde_json::Value) -> Result<()> {
        NewEvent::new("T", "a", "1", payload).validate(&PayloadRules::default())
    }

    fn rejected_at(event: NewEvent) -> Option<String> {
        let err = event.validate(&PayloadRules::default()).err()?;
        assert_eq!(err.code().as_str(), "EVENT_SCHEMA_INVALID", "{err}");
        let msg = err.to_string();
        let path = msg.split("key ").nth(1)?.split(' ').next()?;
        Some(path.to_owned())
    }

    #[test]
    fn secret_looking_keys_are_rejected_at_any_depth() {
        assert!(check(json!({"order_id": "o1", "status": "PAID"})).is_ok());
        for (bad, path) in [
            (json!({"password": "x"}), "payload.password"),
            (
                json!({"customer": {"Email": "a@b"}}),
                "payload.customer.Email",
            ),
            (
                json!({"items": [{"API-Key": "k"}]}),
                "payload.items[0].API-Key",
            ),
            (json!({"accessToken": "t"}), "payload.accessToken"),
            (json!({"phone_number": "1"}), "payload.phone_number"),
        ] {
            let event = NewEvent::new("T", "a", "1", bad.clone());
            assert_eq!(rejected_at(event).as_deref(), Some(path), "{bad}");
        }
    }

    #[test]
    fn metadata_is_checked_like_the_payload() {
        let event = |metadata| NewEvent::new("T", "a", "1", json!({"id": 1})).metadata(metadata);
        assert!(rejected_at(event(json!({"traceparent": "00-abc-def-01"}))).is_none());
        assert_eq!(
            rejected_at(event(json!({"password": "x"}))).as_deref(),
            Some("metadata.password")
        );
        assert_eq!(
            rejected_at(event(json!({"http": {"headers": [{"X-Api-Key": "k"}]}}))).as_deref(),
            Some("metadata.http.headers[0].X-Api-Key")
        );
    }

    #[test]
    fn sensitive_keys_match_whole_words_not_fragments() {
        let rules = PayloadRules::default();
        for caught in [
            "password",
            "userPassword",
            "password_hash",
            "NEW-PASSWORD",
            "password2",
            "api_key",
            "apiKey",
            "APIKey",
            "X-Api-Key",
            "apikey",
            "access_token",
            "accesstoken",
            "refreshToken",
            "client.secret",
            "card_number",
            "cardNumber",
            "customer email",
            "emailAddress",
        ] {
            assert!(rules.is_sensitive(caught), "{caught} should be caught");
        }
        for passes in [
            "payment_authorization_id",
            "tokens_used",
            "order_id",
            "smartphone_model",
            "secretary_id",
            "cardinality",
            "emails_sent",
            "passenger_count",
            "api_version",
        ] {
            assert!(!rules.is_sensitive(passes), "{passes} should pass");
        }
    }

    #[test]
    fn configured_keys_of_several_words_match_as_a_run() {
        let rules = PayloadRules {
            sensitive_keys: normalize_keys(&["credit_card", "IBAN", "", "--"]),
            ..PayloadRules::default()
        };
        assert_eq!(rules.sensitive_keys, vec!["creditcard", "iban"]);
        for caught in [
            "credit_card",
            "creditCard",
            "customer_credit_card_id",
            "IBAN",
            "iban2",
        ] {
            assert!(rules.is_sensitive(caught), "{caught} should be caught");
        }
        for passes in [
            "credit",
            "card",
            "credit_limit_card",
            "credit_cards",
            "password",
        ] {
            assert!(!rules.is_sensitive(passes), "{passes} should pass");
        }
    }

    #[test]
    fn keys_split_into_lower_case_words() {
        for (key, words) in [
            ("userPassword", &["user", "password"][..]),
            ("X-Api-Key", &["x", "api", "key"]),
            ("XMLHttpRequest", &["xml", "http", "request"]),
            ("a.b_c-d e", &["a", "b", "c", "d", "e"]),
            ("oauth2Token", &["oauth", "2", "token"]),
            ("__", &[]),
        ] {
            assert_eq!(key_words(key), words, "{key}");
        }
    }

    #[test]
    fn oversized_payloads_and_bad_envelopes_are_rejected() {
        let big = json!({"blob": "x".repeat(MAX_PAYLOAD_BYTES)});
        assert!(check(big).is_err());
        assert!(NewEvent::new("", "a", "1", json!({}))
            .validate(&PayloadRules::default())
            .is_err());
        assert!(NewEvent::new("T", "a", "1", json!({}))
            .version(0)
            .validate(&PayloadRules::default())
            .is_err());
        assert!(NewEvent::new("T", "", "1", json!({}))
            .validate(&PayloadRules::default())
            .is_err());
    }
}
