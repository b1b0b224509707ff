//! The states of outbox and inbox rows: the values of the `status` columns, named once. The
//! SQL spells them too; these are what the Rust side compares, lists and shows.

/// An inbox row's state, as in the `inbox_events.status` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum InboxStatus {
    /// Written by the fan-out (or a receiving side), not yet attempted.
    Received,
    /// Handled (or recorded as stale); never delivered again.
    Processed,
    /// Failed; due again at its `next_attempt_at`.
    RetryPending,
    /// Failed for good: attempts ran out or the error was permanent.
    DeadLetter,
    /// Set aside by an operator; never delivered again.
    Ignored,
}

impl InboxStatus {
    /// The stored names of [`ALL`](Self::ALL), for the operator API's list filters.
    #[cfg(feature = "admin")]
    pub(crate) fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(Self::as_str).collect()
    }

    /// Every state, in the order of the row's life.
    pub const ALL: [InboxStatus; 5] = [
        InboxStatus::Received,
        InboxStatus::Processed,
        InboxStatus::RetryPending,
        InboxStatus::DeadLetter,
        InboxStatus::Ignored,
    ];

    /// The value stored in the database.
    pub const fn as_str(&self) -> &'static str {
        match self {
            InboxStatus::Received => "RECEIVED",
            InboxStatus::Processed => "PROCESSED",
            InboxStatus::RetryPending => "RETRY_PENDING",
            InboxStatus::DeadLetter => "DEAD_LETTER",
            InboxStatus::Ignored => "IGNORED",
        }
    }

    /// Whether a claim may pick the row (`status IN ('RECEIVED', 'RETRY_PENDING')`); the
    /// harness's model of the claim asks.
    #[cfg(feature = "testing")]
    pub(crate) fn claimable(self) -> bool {
        matches!(self, InboxStatus::Received | InboxStatus::RetryPending)
    }
}

/// An outbox row's state, as in the `outbox_events.status` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum OutboxStatus {
    /// Committed, not yet published.
    Pending,
    /// Leased by an external transport's publisher.
    Processing,
    /// Fanned out to the subscribed consumers' inboxes (or accepted by the broker).
    Published,
    /// An external publish failed; due again at its `next_attempt_at`.
    RetryPending,
    /// An external publish failed for good.
    DeadLetter,
    /// Set aside by an operator; never published.
    Ignored,
}

impl OutboxStatus {
    /// The stored names of [`ALL`](Self::ALL), for the operator API's list filters.
    #[cfg(feature = "admin")]
    pub(crate) fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(Self::as_str).collect()
    }

    /// Every state, in the order of the row's life.
    pub const ALL: [OutboxStatus; 6] = [
        OutboxStatus::Pending,
        OutboxStatus::Processing,
        OutboxStatus::Published,
        OutboxStatus::RetryPending,
        OutboxStatus::DeadLetter,
        OutboxStatus::Ignored,
    ];

    /// The value stored in the database.
    pub const fn as_str(&self) -> &'static str {
        match self {
            OutboxStatus::Pending => "PENDING",
            OutboxStatus::Processing => "PROCESSING",
            OutboxStatus::Published => "PUBLISHED",
            OutboxStatus::RetryPending => "RETRY_PENDING",
            OutboxStatus::DeadLetter => "DEAD_LETTER",
            OutboxStatus::Ignored => "IGNORED",
        }
    }
}
