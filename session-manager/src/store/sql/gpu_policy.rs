//! The SQL of owned GPUs and reservations (migration 0018): `nodes.owner`,
//! `gpus.owner`, `reservations`, and the reservations sessions and job chains use
//! (`session_reservations`, `job_chain_reservations`).

use futures::future::BoxFuture;
use ongrid_core::{GpuUuid, JobId, NodeName, SessionId};

use super::{from_json, parse, parse_timestamp, timestamp, to_json, SqlStore};
use crate::domain::policy::reservations::{ReservationName, ReservationRecord};
use crate::domain::policy::GroupName;
use crate::store::gpu_policy::{
    GpuPolicyStore, Owners, OwnersAndReservations, RequestReservations,
};
use crate::store::{StoreError, StoreResult};

fn reservation_name(text: &str) -> StoreResult<ReservationName> {
    ReservationName::parse(text).map_err(|e| StoreError::Corrupt(format!("reservation: {e}")))
}

type ReservationRow = (
    String,
    String,
    Option<String>,
    String,
    String,
    String,
    String,
    String,
);

impl SqlStore {
    async fn set_gpu_owner(&self, gpu: &GpuUuid, owner: Option<&GroupName>) -> StoreResult<bool> {
        let mut tx = self.write().await?;
        let updated = sqlx::query(
            "UPDATE gpus SET owner = $1 WHERE uuid = $2 \
             AND node IN (SELECT name FROM nodes WHERE removed_at IS NULL)",
        )
        .bind(owner.map(GroupName::as_str))
        .bind(gpu.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        // The owners are kept with the inventory's version (`inventory.rs`).
        if updated == 1 {
            super::inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(updated == 1)
    }

    async fn set_node_owner(
        &self,
        node: &NodeName,
        owner: Option<&GroupName>,
    ) -> StoreResult<bool> {
        let mut tx = self.write().await?;
        let updated =
            sqlx::query("UPDATE nodes SET owner = $1 WHERE name = $2 AND removed_at IS NULL")
                .bind(owner.map(GroupName::as_str))
                .bind(node.as_str())
                .execute(&mut *tx)
                .await?
                .rows_affected();
        if updated == 1 {
            super::inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(updated == 1)
    }

    async fn owners_and_reservations(&self) -> StoreResult<OwnersAndReservations> {
        self.kept_policy().await
    }

    /// The owners and every reservation, read; kept with the inventory's version by
    /// [`Self::kept_policy`].
    pub(super) async fn read_policy(&self) -> StoreResult<OwnersAndReservations> {
        Ok(OwnersAndReservations {
            owners: self.read_owners().await?,
            reservations: self.read_reservations().await?,
        })
    }

    /// Every owner of a node or a GPU, read.
    async fn read_owners(&self) -> StoreResult<Owners> {
        // One statement for both.
        let rows: Vec<(bool, String, String)> = sqlx::query_as(
            "SELECT TRUE, name, owner FROM nodes WHERE owner IS NOT NULL AND removed_at IS NULL \
             UNION ALL \
             SELECT FALSE, g.uuid, g.owner FROM gpus g JOIN nodes n ON n.name = g.node \
             WHERE g.owner IS NOT NULL AND n.removed_at IS NULL",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut owners = Owners::default();
        for (of_node, name, owner) in &rows {
            if *of_node {
                owners
                    .nodes
                    .insert(parse(name, "node name")?, parse(owner, "owner group")?);
            } else {
                owners
                    .gpus
                    .insert(parse(name, "GPU UUID")?, parse(owner, "owner group")?);
            }
        }
        Ok(owners)
    }

    /// Every reservation, ended ones too, by start time.
    async fn read_reservations(&self) -> StoreResult<Vec<ReservationRecord>> {
        let rows: Vec<ReservationRow> = sqlx::query_as(
            "SELECT name, accounting_group, node, gpus, starts_at, ends_at, created_by, \
             created_at FROM reservations ORDER BY starts_at, name",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(reservation_from_row).collect()
    }

    async fn add_reservation(&self, r: &ReservationRecord) -> StoreResult<bool> {
        let mut tx = self.write().await?;
        let inserted = sqlx::query(
            "INSERT INTO reservations (name, accounting_group, node, gpus, starts_at, ends_at, \
             created_by, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(r.name.as_str())
        .bind(r.group.as_str())
        .bind(r.node.as_ref().map(NodeName::as_str))
        .bind(to_json(&r.gpus)?)
        .bind(timestamp(r.from))
        .bind(timestamp(r.to))
        .bind(r.created_by.as_str())
        .bind(timestamp(r.created_at))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        // The reservations are kept with the inventory's version, as the owners are.
        if inserted == 1 {
            super::inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(inserted == 1)
    }

    async fn remove_reservation(
        &self,
        name: &ReservationName,
    ) -> StoreResult<Option<ReservationRecord>> {
        let mut tx = self.write().await?;
        let row: Option<ReservationRow> = sqlx::query_as(
            "DELETE FROM reservations WHERE name = $1 RETURNING name, accounting_group, node, \
             gpus, starts_at, ends_at, created_by, created_at",
        )
        .bind(name.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        if row.is_some() {
            super::inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        row.as_ref().map(reservation_from_row).transpose()
    }

    async fn set_request_reservation(
        &self,
        sql: &str,
        id: String,
        reservation: &ReservationName,
    ) -> StoreResult<()> {
        sqlx::query(sql)
            .bind(id)
            .bind(reservation.as_str())
            .execute(self.writes())
            .await?;
        Ok(())
    }

    async fn request_reservations(&self) -> StoreResult<RequestReservations> {
        // Those of sessions that have not ended: the rows stay (they record what was asked),
        // and a site's ended sessions outnumber its live ones more every day.
        let sessions: Vec<(String, String)> = sqlx::query_as(
            "SELECT r.session_id, r.reservation FROM session_reservations r \
             JOIN sessions s ON s.id = r.session_id WHERE s.state <> 'ENDED'",
        )
        .fetch_all(&self.pool)
        .await?;
        let chains: Vec<(String, String)> =
            sqlx::query_as("SELECT chain_initial, reservation FROM job_chain_reservations")
                .fetch_all(&self.pool)
                .await?;
        Ok(RequestReservations {
            sessions: sessions
                .iter()
                .map(|(id, r)| Ok((parse(id, "session id")?, reservation_name(r)?)))
                .collect::<StoreResult<_>>()?,
            chains: chains
                .iter()
                .map(|(id, r)| Ok((parse(id, "job id")?, reservation_name(r)?)))
                .collect::<StoreResult<_>>()?,
        })
    }
}

fn reservation_from_row(row: &ReservationRow) -> StoreResult<ReservationRecord> {
    let (name, owner, node, gpus, from, to, by, at) = row;
    Ok(ReservationRecord {
        name: reservation_name(name)?,
        group: parse(owner, "owner group")?,
        node: node.as_deref().map(|n| parse(n, "node name")).transpose()?,
        gpus: from_json(gpus, "reserved GPUs")?,
        from: parse_timestamp(from)?,
        to: parse_timestamp(to)?,
        created_by: parse(by, "user name")?,
        created_at: parse_timestamp(at)?,
    })
}

impl GpuPolicyStore for SqlStore {
    boxed! {
        fn set_gpu_owner(gpu: &'a GpuUuid, owner: Option<&'a GroupName>) -> bool;
        fn set_node_owner(node: &'a NodeName, owner: Option<&'a GroupName>) -> bool;
        fn owners_and_reservations() -> OwnersAndReservations;
        fn add_reservation(reservation: &'a ReservationRecord) -> bool;
        fn remove_reservation(name: &'a ReservationName) -> Option<ReservationRecord>;
        fn request_reservations() -> RequestReservations;
    }

    fn set_session_reservation<'a>(
        &'a self,
        id: SessionId,
        reservation: &'a ReservationName,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.set_request_reservation(
            "INSERT INTO session_reservations (session_id, reservation) VALUES ($1, $2) \
             ON CONFLICT (session_id) DO UPDATE SET reservation = excluded.reservation",
            id.to_string(),
            reservation,
        ))
    }

    fn set_chain_reservation<'a>(
        &'a self,
        initial: JobId,
        reservation: &'a ReservationName,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.set_request_reservation(
            "INSERT INTO job_chain_reservations (chain_initial, reservation) \
             VALUES ($1, $2) \
             ON CONFLICT (chain_initial) DO UPDATE SET reservation = excluded.reservation",
            initial.to_string(),
            reservation,
        ))
    }
}
