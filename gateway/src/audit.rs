//! Connection events for the manager's audit log (`POST /v1/gateway/connections`): `open` once a
//! connection is routed to a session, `close` with the bytes each way when it ends. Events go
//! through a bounded queue to one reporter task, so the SSH path never waits for the manager and
//! a connection's `open` always reaches the manager before its `close`. Each event is tried a
//! few times, then logged and dropped.

use std::time::Duration;

use ongrid_core::api::{ConnectionEvent, ConnectionEventKind};
use tokio::sync::mpsc;

use crate::manager::ManagerClient;

/// Events waiting for the reporter; beyond this they are dropped (and logged).
pub const QUEUE: usize = 1024;
/// Delays before the second, third and fourth attempt.
const RETRY_DELAYS: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
];

/// Where connections put their events.
#[derive(Debug, Clone)]
pub struct AuditSender {
    queue: mpsc::Sender<ConnectionEvent>,
}

impl AuditSender {
    /// Queues `event` without waiting; a full queue drops it with an error in the log.
    pub fn send(&self, event: ConnectionEvent) {
        if let Err(error) = self.queue.try_send(event) {
            let event = match &error {
                mpsc::error::TrySendError::Full(event)
                | mpsc::error::TrySendError::Closed(event) => event,
            };
            tracing::error!(
                connection = %event.connection_id,
                event = kind(event.event),
                "Audit queue full or closed: connection event not reported to the manager."
            );
        }
    }
}

/// A queue of `capacity` events: the sender side and the receiver for [`report`].
pub fn queue(capacity: usize) -> (AuditSender, mpsc::Receiver<ConnectionEvent>) {
    let (queue, receiver) = mpsc::channel(capacity);
    (AuditSender { queue }, receiver)
}

/// Delivers queued events in order until every sender is gone.
pub async fn report(manager: ManagerClient, mut events: mpsc::Receiver<ConnectionEvent>) {
    while let Some(event) = events.recv().await {
        deliver(&manager, &event).await;
    }
}

async fn deliver(manager: &ManagerClient, event: &ConnectionEvent) {
    let mut attempt = 0;
    loop {
        match manager.connection_event(event).await {
            Ok(()) => {
                tracing::debug!(connection = %event.connection_id, event = kind(event.event), "Connection event reported.");
                return;
            }
            Err(error) => {
                let error = anyhow::Error::from(error);
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
        ConnectionEventKind::Close => "close",
    }
}
