//! One leader per PostgreSQL database: of the manager replicas serving it, the one that holds a
//! session-level advisory lock ([`MANAGER_LOCK`]) on a connection of its own runs the scheduler
//! and the timers ([`crate::replicas`]); the others serve the API and wait for the lock
//! (PostgreSQL hands it over the moment it is free: when the leader stops, or its process dies
//! and its connection closes). Nothing the leader decided (holds, deadlines, placements) is lost
//! when another takes over, as every decision is read back from the database.
//!
//! A leader that can no longer reach its lock connection must step down, since another one may
//! have taken over: [`ActiveLock::lost`] answers when a ping fails or takes longer than
//! [`PING_TIMEOUT`], checked every [`PING_INTERVAL`]. So a replica that just took the lock waits
//! [`TAKEOVER_GRACE`] before it schedules: by then a leader that lost its connection has noticed
//! and stopped its rounds, and no GPU is handed out by two leaders at once.

use std::time::Duration;

use sqlx::{ConnectOptions, Connection, PgConnection};

use super::PostgresStore;
use crate::store::StoreResult;

/// The advisory lock of the leader ("ongrid" and 2).
pub const MANAGER_LOCK: i64 = 0x6f6e_6772_6964_0002;

/// How often the leader checks that it still holds its lock.
pub const PING_INTERVAL: Duration = Duration::from_secs(1);

/// A ping of the lock connection slower than this counts as a lost connection.
pub const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a replica that took the lock waits before it leads: the longest a leader that lost
/// its lock connection may take to notice ([`PING_INTERVAL`] + [`PING_TIMEOUT`]).
pub const TAKEOVER_GRACE: Duration = PING_INTERVAL.saturating_add(PING_TIMEOUT);

/// The leader's hold on [`MANAGER_LOCK`]; dropping it closes the connection, which
/// releases the lock.
#[derive(Debug)]
pub struct ActiveLock {
    connection: PgConnection,
}

impl PostgresStore {
    /// Takes [`MANAGER_LOCK`], waiting as long as another manager holds it; `on_wait` is called
    /// once when it must wait.
    pub async fn activate(&self, on_wait: impl FnOnce()) -> StoreResult<ActiveLock> {
        // Waiting for the lock is no slow statement to warn about.
        let options = (*self.options).clone().disable_statement_logging();
        let mut connection = PgConnection::connect_with(&options).await?;
        // The wait for the lock is meant to be long: no lock_timeout on this connection.
        sqlx::query("SET lock_timeout = 0")
            .execute(&mut connection)
            .await?;
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(MANAGER_LOCK)
            .fetch_one(&mut connection)
            .await?;
        if !taken {
            on_wait();
            sqlx::query("SELECT pg_advisory_lock($1)")
                .bind(MANAGER_LOCK)
                .execute(&mut connection)
                .await?;
        }
        Ok(ActiveLock { connection })
    }
}

impl ActiveLock {
    /// Returns when the lock connection no longer answers (the lock may be another manager's
    /// by then), with why.
    pub async fn lost(&mut self) -> String {
        loop {
            tokio::time::sleep(PING_INTERVAL).await;
            match tokio::time::timeout(PING_TIMEOUT, self.connection.ping()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return format!("the database connection holding it failed: {e}"),
                Err(_) => {
                    return format!(
                        "the database did not answer on the connection holding it within {} s",
                        PING_TIMEOUT.as_secs()
                    )
                }
            }
        }
    }

    /// The server process of the lock connection (tests end it to play a dead manager).
    #[cfg(test)]
    pub(crate) async fn backend_pid(&mut self) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut self.connection)
            .await
            .unwrap()
    }
}
