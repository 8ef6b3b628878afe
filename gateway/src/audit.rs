//! Connection events for the manager's audit log (`POST /v1/gateway/connections`): `open` once a
//! connection is routed to a session, `activity` with the bytes each way so far every
//! `activity_report` while it is open (SSH traffic keeps a session from being idle), `close`
//! with the totals when it ends. Events go through a bounded queue to one reporter task, so the
//! SSH path never waits for the manager and a connection's events reach the manager in order.
//! `open` and `close` are tried a few times, then logged and dropped; an `activity` event once
//! (the next one carries the same totals and more).
//!
//! The manager answers with the session's deadlines; the reporter hands them to the connection
//! (a [`DeadlinesSender`]) for the banner and the hold warning (`deadlines.rs`). An answer
//! without them (an older manager's 204, a session that is gone) is not an error.

use std::time::Duration;

use ongrid_core::api::{ConnectionEvent, ConnectionEventKind};
use tokio::sync::mpsc;

use crate::deadlines::{DeadlinesSender, DeadlinesState};
use crate::manager::GatewayRoutes;

/// Events waiting for the reporter; beyond this they are dropped (and logged).
pub const QUEUE: usize = 1024;
/// Delays before the second, third and fourth attempt.
const RETRY_DELAYS: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
];

/// An event waiting for the reporter, and where the manager's answer goes.
#[derive(Debug)]
pub struct Queued {
    event: ConnectionEvent,
    deadlines: Option<DeadlinesSender>,
}

/// Where connections put their events.
#[derive(Debug, Clone)]
pub struct AuditSender {
    queue: mpsc::Sender<Queued>,
}

impl AuditSender {
    /// Queues `event` without waiting; a full queue drops it with an error in the log.
    pub fn send(&self, event: ConnectionEvent) {
        self.queue_event(Queued {
            event,
            deadlines: None,
        });
    }

    /// Like [`AuditSender::send`]; the deadlines the manager answers go to `deadlines`.
    pub fn send_for_deadlines(&self, event: ConnectionEvent, deadlines: DeadlinesSender) {
        self.queue_event(Queued {
            event,
            deadlines: Some(deadlines),
        });
    }

    fn queue_event(&self, queued: Queued) {
        if let Err(error) = self.queue.try_send(queued) {
            let queued = match error {
                mpsc::error::TrySendError::Full(queued)
                | mpsc::error::TrySendError::Closed(queued) => queued,
            };
            let event = &queued.event;
            if event.event == ConnectionEventKind::Activity {
                tracing::warn!(connection = %event.connection_id, "Audit queue full: an activity report was dropped.");
            } else {
                tracing::error!(
                    connection = %event.connection_id,
                    event = kind(event.event),
                    "Audit queue full or closed: connection event not reported to the manager."
                );
            }
            unanswered(queued.deadlines.as_ref());
        }
    }
}

/// A queue of `capacity` events: the sender side and the receiver for [`report`].
pub fn queue(capacity: usize) -> (AuditSender, mpsc::Receiver<Queued>) {
    let (queue, receiver) = mpsc::channel(capacity);
    (AuditSender { queue }, receiver)
}

/// Delivers queued events in order until every sender is gone.
pub async fn report(manager: GatewayRoutes, mut events: mpsc::Receiver<Queued>) {
    while let Some(queued) = events.recv().await {
        deliver(&manager, &queued.event, queued.deadlines.as_ref()).await;
    }
}

/// Nothing will come for a connection still waiting for its first deadlines: say so, so its
/// shells start without a banner instead of waiting.
fn unanswered(deadlines: Option<&DeadlinesSender>) {
    if let Some(deadlines) = deadlines {
        deadlines.send_if_modified(|state| {
            let pending = *state == DeadlinesState::Pending;
            if pending {
                *state = DeadlinesState::Unavailable;
            }
            pending
        });
    }
}

async fn deliver(
    manager: &GatewayRoutes,
    event: &ConnectionEvent,
    deadlines: Option<&DeadlinesSender>,
) {
    let mut attempt = 0;
    loop {
        match manager.connection_event(event).await {
            Ok(answer) => {
                tracing::debug!(connection = %event.connection_id, event = kind(event.event), deadlines = answer.is_some(), "Connection event reported.");
                match (answer, deadlines) {
                    (Some(answer), Some(deadlines)) => {
                        deadlines.send_replace(DeadlinesState::Known(answer));
                    }
                    (None, deadlines) => unanswered(deadlines),
                    (Some(_), None) => {}
                }
                return;
            }
            Err(error) => {
                let error = anyhow::Error::from(error);
                if event.event == ConnectionEventKind::Activity {
                    tracing::warn!(connection = %event.connection_id, error = format!("{error:#}"), "Reporting a connection's activity failed; the next report carries it.");
                    unanswered(deadlines);
                    return;
                }
                match RETRY_DELAYS.get(attempt) {
                    Some(delay) => {
                        tracing::warn!(connection = %event.connection_id, event = kind(event.event), error = format!("{error:#}"), "Reporting a connection event failed; retrying.");
                        tokio::time::sleep(*delay).await;
                        attempt += 1;
                    }
                    None => {
                        tracing::error!(
                            connection = %event.connection_id,
                            event = kind(event.event),
                            owner = %event.owner,
                            source = %event.source,
                            session = %event.session_id,
                            bytes_in = event.bytes_in,
                            bytes_out = event.bytes_out,
                            error = format!("{error:#}"),
                            "Connection event not reported to the manager; it is missing from the audit log."
                        );
                        unanswered(deadlines);
                        return;
                    }
                }
            }
        }
    }
}

fn kind(kind: ConnectionEventKind) -> &'static str {
    match kind {
        ConnectionEventKind::Open => "open",
        ConnectionEventKind::Activity => "activity",
        ConnectionEventKind::Close => "close",
    }
}
