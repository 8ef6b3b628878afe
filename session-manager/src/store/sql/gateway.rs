//! The SQL of the SSH gateway: users' keys (`ssh_keys`), the institutes allowlist
//! (`institutes`, networks as a JSON array of CIDR text) and the audit log of connections
//! (`connections`), whose open rows also say whether a session has a connection open.

use chrono::{DateTime, Utc};
use ongrid_core::api::{AuditRecord, ConnectionEvent, ConnectionEventKind};
use ongrid_core::{normalize_ip, Cidr, Dn, Institute, InstituteName, SessionId};
use sqlx::Row;

use super::{
    apply_change, clamp, find_session, from_json, parse, parse_timestamp, query_with, timestamp,
    to_json, Db, DbRow, SqlStore,
};
use crate::domain::sessions::connections::follow_connection;
use crate::store::{
    AuditFilter, ConnectionRecorded, KeyAdded, KeyRecord, NewKey, StoreError, StoreResult,
};

pub(super) const KEY_COLUMNS: &str =
    "k.fingerprint, k.owner, u.user_name, k.algorithm, k.public_key, \
     k.comment, k.added_at, k.expires_at, k.fqans, k.token_issuer FROM ssh_keys k JOIN users u \
     ON u.dn = k.owner";

const AUDIT_COLUMNS: &str = "c.id, c.owner, c.fingerprint, c.source, c.institute, c.session_id, \
     s.name AS session_name, c.opened_at, c.closed_at, c.bytes_in, c.bytes_out, c.close_reason \
     FROM connections c JOIN sessions s ON s.id = c.session_id";

impl SqlStore {
    pub(super) async fn add_key(&self, key: NewKey, max_per_owner: usize) -> StoreResult<KeyAdded> {
        let mut tx = self.write().await?;
        super::refuse_removed(&mut tx, &key.owner).await?;
        let existing: Option<String> =
            sqlx::query_scalar("SELECT owner FROM ssh_keys WHERE fingerprint = $1")
                .bind(&key.fingerprint)
                .fetch_optional(&mut *tx)
                .await?;
        let renewed = match existing {
            Some(owner) if owner == key.owner.as_str() => {
                sqlx::query(
                    "UPDATE ssh_keys SET expires_at = $1, comment = $2, fqans = $3, \
                     token_issuer = $4 WHERE fingerprint = $5",
                )
                .bind(timestamp(key.expires_at))
                .bind(&key.comment)
                .bind(to_json(&key.fqans)?)
                .bind(key.token_issuer.as_deref())
                .bind(&key.fingerprint)
                .execute(&mut *tx)
                .await?;
                true
            }
            Some(_) => {
                return Err(StoreError::KeyTaken {
                    fingerprint: key.fingerprint,
                })
            }
            None => {
                let count: i64 =
                    sqlx::query_scalar("SELECT COUNT(*) FROM ssh_keys WHERE owner = $1")
                        .bind(key.owner.as_str())
                        .fetch_one(&mut *tx)
                        .await?;
                if usize::try_from(count).unwrap_or(usize::MAX) >= max_per_owner {
                    return Err(StoreError::TooManyKeys { max: max_per_owner });
                }
                sqlx::query(
                    "INSERT INTO ssh_keys (fingerprint, owner, algorithm, public_key, comment, \
                     added_at, expires_at, fqans, token_issuer) VALUES ($1, $2, $3, $4, $5, $6, \
                     $7, $8, $9)",
                )
                .bind(&key.fingerprint)
                .bind(key.owner.as_str())
                .bind(&key.algorithm)
                .bind(&key.public_key)
                .bind(&key.comment)
                .bind(timestamp(key.at))
                .bind(timestamp(key.expires_at))
                .bind(to_json(&key.fqans)?)
                .bind(key.token_issuer.as_deref())
                .execute(&mut *tx)
                .await?;
                false
            }
        };
        let record = find_key(&mut *tx, &key.fingerprint)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("key {} vanished", key.fingerprint)))?;
        tx.commit().await?;
        Ok(if renewed {
            KeyAdded::Renewed(record)
        } else {
            KeyAdded::New(record)
        })
    }

    pub(super) async fn key(&self, fingerprint: &str) -> StoreResult<Option<KeyRecord>> {
        find_key(&self.pool, fingerprint).await
    }

    pub(super) async fn keys(&self, owner: Option<&Dn>) -> StoreResult<Vec<KeyRecord>> {
        let order = "ORDER BY k.owner, k.added_at, k.fingerprint";
        let sql = match owner {
            Some(_) => format!("SELECT {KEY_COLUMNS} WHERE k.owner = $1 {order}"),
            None => format!("SELECT {KEY_COLUMNS} {order}"),
        };
        let rows = query_with(&sql, owner.map(Dn::as_str))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(key_from_row).collect()
    }

    pub(super) async fn remove_key(
        &self,
        fingerprint: &str,
        owner: Option<&Dn>,
    ) -> StoreResult<Option<KeyRecord>> {
        let mut tx = self.write().await?;
        let Some(key) = find_key(&mut *tx, fingerprint).await? else {
            return Ok(None);
        };
        if owner.is_some_and(|owner| *owner != key.owner) {
            return Ok(None);
        }
        sqlx::query("DELETE FROM ssh_keys WHERE fingerprint = $1")
            .bind(fingerprint)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(key))
    }

    pub(super) async fn add_institute(
        &self,
        institute: &Institute,
        at: DateTime<Utc>,
    ) -> StoreResult<()> {
        let cidrs: Vec<String> = institute.cidrs.iter().map(Cidr::to_string).collect();
        let mut tx = self.write().await?;
        let inserted = sqlx::query(
            "INSERT INTO institutes (name, cidrs, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(institute.name.as_str())
        .bind(to_json(&cidrs)?)
        .bind(timestamp(at))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted == 0 {
            return Err(StoreError::InstituteExists(institute.name.clone()));
        }
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn institute(&self, name: &InstituteName) -> StoreResult<Option<Institute>> {
        let row = sqlx::query("SELECT name, cidrs FROM institutes WHERE name = $1")
            .bind(name.as_str())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(institute_from_row).transpose()
    }

    pub(super) async fn institutes(&self) -> StoreResult<Vec<Institute>> {
        let rows = sqlx::query("SELECT name, cidrs FROM institutes ORDER BY name")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(institute_from_row).collect()
    }

    pub(super) async fn remove_institute(
        &self,
        name: &InstituteName,
    ) -> StoreResult<Option<Institute>> {
        let mut tx = self.write().await?;
        let row = sqlx::query("DELETE FROM institutes WHERE name = $1 RETURNING name, cidrs")
            .bind(name.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        row.as_ref().map(institute_from_row).transpose()
    }

    pub(super) async fn record_connection(
        &self,
        event: &ConnectionEvent,
        at: DateTime<Utc>,
    ) -> StoreResult<ConnectionRecorded> {
        let id = event.session_id;
        let mut tx = self.write().await?;
        let before = find_session(&mut *tx, id)
            .await?
            .ok_or(StoreError::NoSuchSession(id))?;
        let connection_id = event.connection_id.to_string();
        let bytes_in = clamp(event.bytes_in);
        let bytes_out = clamp(event.bytes_out);
        let insert = "INSERT INTO connections (id, owner, fingerprint, source, institute, \
             session_id, opened_at, closed_at, bytes_in, bytes_out, close_reason) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (id) DO NOTHING";
        let closed_at = match event.event {
            ConnectionEventKind::Open | ConnectionEventKind::Activity => None,
            ConnectionEventKind::Close => Some(timestamp(event.at)),
        };
        super::activity::note_traffic(&mut tx, event, at).await?;
        let updated = match event.event {
            // A repeated open (a retry) finds the row and changes nothing.
            ConnectionEventKind::Open => 0,
            ConnectionEventKind::Activity => {
                super::activity::record_activity_report(&mut tx, event, at).await?
            }
            ConnectionEventKind::Close => sqlx::query(
                "UPDATE connections SET closed_at = $1, bytes_in = $2, bytes_out = $3, \
                 close_reason = $4 WHERE id = $5",
            )
            .bind(&closed_at)
            .bind(bytes_in)
            .bind(bytes_out)
            .bind(&event.close_reason)
            .bind(&connection_id)
            .execute(&mut *tx)
            .await?
            .rows_affected(),
        };
        if updated == 0 {
            // An open, or a close whose open never arrived: then it opened, as far as anyone
            // knows, when it closed.
            sqlx::query(insert)
                .bind(&connection_id)
                .bind(event.owner.as_str())
                .bind(&event.fingerprint)
                .bind(normalize_ip(event.source).to_string())
                .bind(event.institute.as_str())
                .bind(id.to_string())
                .bind(timestamp(event.at))
                .bind(&closed_at)
                .bind(bytes_in)
                .bind(bytes_out)
                .bind(&event.close_reason)
                .execute(&mut *tx)
                .await?;
        }
        super::activity::after_connection_event(&mut tx, event, at).await?;
        let open = count_open(&mut tx, id).await?;
        let transition = match follow_connection(before.state, event, open, at) {
            Some(change) => Some(apply_change(&mut tx, id, change).await?),
            None => None,
        };
        let session = find_session(&mut *tx, id)
            .await?
            .ok_or(StoreError::NoSuchSession(id))?;
        tx.commit().await?;
        Ok(ConnectionRecorded {
            session,
            open_connections: open,
            transition,
        })
    }

    pub(super) async fn prune_connections(
        &self,
        closed_before: DateTime<Utc>,
        limit: u32,
    ) -> StoreResult<u64> {
        // `opened_at` too, which a connection closed before then was, for its index.
        let done = sqlx::query(
            "DELETE FROM connections WHERE id IN (SELECT id FROM connections \
             WHERE closed_at IS NOT NULL AND closed_at < $1 AND opened_at < $1 \
             ORDER BY opened_at LIMIT $2)",
        )
        .bind(timestamp(closed_before))
        .bind(i64::from(limit))
        .execute(self.writes())
        .await?;
        Ok(done.rows_affected())
    }

    pub(super) async fn audit(&self, filter: AuditFilter) -> StoreResult<Vec<AuditRecord>> {
        // Parameters are numbered in the order they are bound: owner, since, limit.
        let mut conditions = Vec::new();
        if filter.owner.is_some() {
            conditions.push(format!("c.owner = ${}", conditions.len() + 1));
        }
        if filter.since.is_some() {
            conditions.push(format!(
                "(c.closed_at IS NULL OR c.closed_at >= ${})",
                conditions.len() + 1
            ));
        }
        let limit = conditions.len() + 1;
        let condition = if conditions.is_empty() {
            "TRUE".to_owned()
        } else {
            conditions.join(" AND ")
        };
        let sql = format!(
            "SELECT {AUDIT_COLUMNS} WHERE {condition} ORDER BY c.opened_at DESC, c.id LIMIT ${limit}"
        );
        let mut query = sqlx::query(&sql);
        if let Some(owner) = &filter.owner {
            query = query.bind(owner.as_str());
        }
        if let Some(since) = filter.since {
            query = query.bind(timestamp(since));
        }
        let rows = query
            .bind(i64::from(filter.limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(audit_from_row).collect()
    }
}

async fn find_key<'e, E>(executor: E, fingerprint: &str) -> StoreResult<Option<KeyRecord>>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let row = sqlx::query(&format!("SELECT {KEY_COLUMNS} WHERE k.fingerprint = $1"))
        .bind(fingerprint)
        .fetch_optional(executor)
        .await?;
    row.as_ref().map(key_from_row).transpose()
}

async fn count_open(tx: &mut sqlx::Transaction<'static, Db>, id: SessionId) -> StoreResult<u32> {
    let open: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM connections WHERE session_id = $1 AND closed_at IS NULL",
    )
    .bind(id.to_string())
    .fetch_one(&mut **tx)
    .await?;
    u32::try_from(open).map_err(|_| StoreError::Corrupt(format!("{open} open connections")))
}

pub(super) fn key_from_row(row: &DbRow) -> StoreResult<KeyRecord> {
    let text = |column: &str| row.try_get::<String, _>(column);
    Ok(KeyRecord {
        fingerprint: text("fingerprint")?,
        owner: parse(&text("owner")?, "owner DN")?,
        user_name: parse(&text("user_name")?, "user name")?,
        algorithm: text("algorithm")?,
        public_key: text("public_key")?,
        comment: text("comment")?,
        added_at: parse_timestamp(&text("added_at")?)?,
        expires_at: parse_timestamp(&text("expires_at")?)?,
        fqans: row
            .try_get::<Option<String>, _>("fqans")?
            .map(|fqans| from_json(&fqans, "key's FQANs"))
            .transpose()?,
        token_issuer: row.try_get("token_issuer")?,
    })
}

fn institute_from_row(row: &DbRow) -> StoreResult<Institute> {
    let name: String = row.try_get("name")?;
    let cidrs: Vec<String> = from_json(&row.try_get::<String, _>("cidrs")?, "institute networks")?;
    Ok(Institute {
        name: parse(&name, "institute name")?,
        cidrs: cidrs
            .iter()
            .map(|c| parse(c, "network"))
            .collect::<StoreResult<Vec<Cidr>>>()?,
    })
}

fn audit_from_row(row: &DbRow) -> StoreResult<AuditRecord> {
    let text = |column: &str| row.try_get::<String, _>(column);
    let count = |column: &str| -> StoreResult<u64> {
        let value: i64 = row.try_get(column)?;
        u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("{column} {value}")))
    };
    Ok(AuditRecord {
        connection_id: parse(&text("id")?, "connection id")?,
        owner: parse(&text("owner")?, "owner DN")?,
        fingerprint: text("fingerprint")?,
        source: parse(&text("source")?, "source address")?,
        institute: parse(&text("institute")?, "institute name")?,
        session_id: parse(&text("session_id")?, "session id")?,
        session_name: parse(&text("session_name")?, "session name")?,
        opened_at: parse_timestamp(&text("opened_at")?)?,
        closed_at: row
            .try_get::<Option<String>, _>("closed_at")?
            .map(|t| parse_timestamp(&t))
            .transpose()?,
        bytes_in: count("bytes_in")?,
        bytes_out: count("bytes_out")?,
        close_reason: row.try_get("close_reason")?,
    })
}
