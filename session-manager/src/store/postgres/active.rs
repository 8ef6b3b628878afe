//! One active manager per PostgreSQL database: the active one holds a session-level advisory lock
//! ([`MANAGER_LOCK`]) on a connection of its own for as long as it runs. A second manager
//! started against the same database waits for that lock as a standby (PostgreSQL wakes it the
//! moment the lock is free: when the active manager stops, or its process dies and its
//! connection closes) and only then serves. So two managers never schedule at once: no GPU is
//! handed out twice, and nothing the active one stored (holds, deadlines, placements) is lost,
//! as every decision is read back from the database by the one that takes over.
//!
//! An active manager that can no longer reach its lock connection must stop, since another one
//! may have taken over: [`ActiveLock::lost`] answers when a ping fails or takes longer than
//! [`PING_TIMEOUT`], checked every [`PING_INTERVAL`].

use std::time::Duration;

use sqlx::{ConnectOptions, Connection, PgConnection};

use super::PostgresStore;
use crate::store::StoreResult;

/// The advisory lock of the active manager ("ongrid" and 2).
pub const MANAGER_LOCK: i64 = 0x6f6e_6772_6964_0002;

/// How often the active manager checks that it still holds its lock.
pub const PING_INTERVAL: Duration = Duration::from_secs(1);

/// A ping of the lock connection slower than this counts as a lost connection.
pub const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// The active manager's hold on [`MANAGER_LOCK`]; dropping it closes the connection, which
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
