//! The boot-time contract check: what this build registers (consumers and their
//! subscriptions, event types, upcasters) against what the database holds (the subscriptions,
//! the types and versions of the newest outbox events). Each mismatch is a finding, stored
//! for health (`CONTRACT_MISMATCH`) until a start finds it fixed, and a warning at start, or,
//! with [`ContractCheck::Refuse`], a start that fails.

use crate::consumer::ConsumerConfig;
use crate::error::{Error, Result};
use crate::event::EventRegistry;
use crate::store::contract::{self, Finding, Stored};
use diesel_async::AsyncPgConnection;

/// What a start does with the contract check's findings
/// ([`RuntimeConfig::contract_check`](crate::RuntimeConfig::contract_check)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ContractCheck {
    /// No check.
    Off,
    /// Each finding is logged as a warning and reported by health until fixed. The default.
    #[default]
    Warn,
    /// As `Warn`, and a start with any finding fails (`CONFIG_INVALID`) before a consumer
    /// runs.
    Refuse,
}

/// A consumer of this build: its name, the types it subscribes to, the subscriptions the
/// database holds for it that it no longer lists, and, of its HIGH types, the other cursor
/// consumers that read one LOW (type, consumer), which keeps that type in the LOW lane.
pub(crate) struct Registered<'a> {
    pub cfg: &'a ConsumerConfig,
    pub extra: Vec<String>,
    pub low_readers: Vec<(String, String)>,
}

/// The findings, from what was read. Pure, so that each rule is tested on its own.
pub(crate) fn findings(
    consumers: &[Registered<'_>],
    stored: &[Stored],
    registry: Option<&EventRegistry>,
    window: i64,
) -> Vec<Finding> {
    let finding = |code: &str, consumer: &str, event_type: &str, detail: String, message| Finding {
        code: code.to_owned(),
        consumer: consumer.to_owned(),
        event_type: event_type.to_owned(),
        detail,
        message,
    };
    let mut out = Vec::new();
    for c in consumers {
        let name = c.cfg.name.as_str();
        for t in &c.extra {
            out.push(finding(
                "SUBSCRIPTION_UNHANDLED",
                name,
                t,
                String::new(),
                format!(
                    "{name} is subscribed to {t} in the database, but this build's {name} does \
                     not subscribe to it: its events are still fanned out to {name}; remove the \
                     subscription (ops::unsubscribe) once no instance needs it"
                ),
            ));
        }
        for (t, reader) in &c.low_readers {
            out.push(finding(
                "HIGH_LANE_OVERRULED",
                name,
                t,
                reader.clone(),
                format!(
                    "{name} subscribes to {t} as HIGH, but the cursor consumer {reader} reads \
                     it LOW: an event is HIGH only when every cursor consumer of its type asks, \
                     so {t} stays in the LOW lane for all"
                ),
            ));
        }
        if stored.is_empty() {
            continue;
        }
        for t in &c.cfg.event_types {
            let written = stored.iter().any(|s| &s.event_type == t);
            let known = registry.is_some_and(|r| r.registers(t));
            if !written && !known {
                out.push(finding(
                    "SUBSCRIBED_TYPE_UNSEEN",
                    name,
                    t,
                    String::new(),
                    format!(
                        "{name} subscribes to {t}, which none of the newest {window} events has \
                         and no registered event type names: a typo?"
                    ),
                ));
            }
        }
    }
    if let Some(registry) = registry {
        for s in stored {
            if let Some(why) = registry.unliftable(&s.event_type, s.event_version) {
                out.push(finding(
                    "VERSION_UNLIFTABLE",
                    "",
                    &s.event_type,
                    format!("v{}", s.event_version),
                    format!(
                        "{why}: stored {} v{} events (among the newest {window}) cannot be \
                         read by this build, and are dead-lettered when delivered",
                        s.event_type, s.event_version
                    ),
                ));
            }
        }
    }
    out
}

/// Runs the check at start: reads, stores the findings (replacing this build's earlier ones),
/// logs each, and refuses the start if asked to.
pub(crate) async fn check(
    conn: &mut AsyncPgConnection,
    mode: ContractCheck,
    window: u32,
    consumers: &[Registered<'_>],
    registry: Option<&EventRegistry>,
) -> Result<()> {
    if mode == ContractCheck::Off {
        return Ok(());
    }
    let window = i64::from(window);
    let stored = contract::stored(conn, window).await?;
    let found = findings(consumers, &stored, registry, window);
    let names: Vec<String> = consumers.iter().map(|c| c.cfg.name.to_string()).collect();
    let types: Vec<String> = stored
        .iter()
        .map(|s| s.event_type.clone())
        .filter(|t| registry.is_some_and(|r| r.registers(t)))
        .collect();
    contract::replace(conn, &names, &types, &found, crate::store::process_id()).await?;
    for f in &found {
        tracing::warn!(code = "CONTRACT_MISMATCH", finding = %f.code, consumer = %f.consumer,
            event_type = %f.event_type, "{}", f.message);
    }
    if mode == ContractCheck::Refuse && !found.is_empty() {
        let all: Vec<&str> = found.iter().map(|f| f.message.as_str()).collect();
        return Err(Error::Config(format!(
            "the contract check found {} mismatch(es): {}",
            found.len(),
            all.join("; ")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Event;
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    struct Placed {
        id: String,
    }
    impl Event for Placed {
        const TYPE: &'static str = "PLACED";
        const VERSION: i32 = 3;
        const AGGREGATE_TYPE: &'static str = "order";
        fn aggregate_id(&self) -> String {
            self.id.clone()
        }
    }

    fn stored(t: &str, v: i32) -> Stored {
        Stored {
            event_type: t.to_owned(),
            event_version: v,
        }
    }

    fn codes(f: &[Finding]) -> Vec<(&str, &str, &str)> {
        f.iter()
            .map(|f| (f.code.as_str(), f.consumer.as_str(), f.event_type.as_str()))
            .collect()
    }

    #[test]
    fn each_rule_finds_its_mismatch_and_nothing_else() {
        let registry = EventRegistry::new()
            .register::<Placed>()
            .upcaster("PLACED", 2, Ok);
        let mail = ConsumerConfig::new("mail")
            .subscribe("PLACED")
            .subscribe("PLACDE");
        let ledger = ConsumerConfig::new("ledger").subscribe("SHIPPED");
        let consumers = [
            Registered {
                cfg: &mail,
                extra: vec!["CANCELLED".into()],
                low_readers: vec![("PLACED".into(), "audit".into())],
            },
            Registered {
                cfg: &ledger,
                extra: vec![],
                low_readers: vec![],
            },
        ];
        let window = [
            stored("PLACED", 1),
            stored("PLACED", 2),
            stored("PLACED", 3),
            stored("SHIPPED", 1),
        ];
        let found = findings(&consumers, &window, Some(&registry), 100);
        assert_eq!(
            codes(&found),
            vec![
                ("SUBSCRIPTION_UNHANDLED", "mail", "CANCELLED"),
                ("HIGH_LANE_OVERRULED", "mail", "PLACED"),
                ("SUBSCRIBED_TYPE_UNSEEN", "mail", "PLACDE"),
                ("VERSION_UNLIFTABLE", "", "PLACED"),
            ]
        );
        assert_eq!(found[1].detail, "audit");
        assert_eq!(found[3].detail, "v1");
        assert!(found[3].message.contains("PLACED v1 has no upcaster to v2"));
        // A fresh database: nothing stored, so no type is "unseen" yet.
        let fresh = findings(&consumers, &[], Some(&registry), 100);
        assert_eq!(
            codes(&fresh),
            vec![
                ("SUBSCRIPTION_UNHANDLED", "mail", "CANCELLED"),
                ("HIGH_LANE_OVERRULED", "mail", "PLACED"),
            ]
        );
        // A newer version than this build reads is a rolling deploy, not a finding.
        let newer = findings(
            &consumers[1..],
            &[stored("PLACED", 4), stored("SHIPPED", 1)],
            Some(&registry),
            100,
        );
        assert!(newer.is_empty(), "{newer:?}");
    }
}
