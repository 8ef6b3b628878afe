//! The SQL of frozen images (`images`, migration 0005): a row per freeze, from BUILDING
//! to READY or FAILED and then DELETED. A tag (owner, name, version) has at most one current row
//! (a partial unique index); `freeze --force` supersedes the old one, which keeps its digest.
//! `shared_at` (migration 0011) is set while the owner shares the image.

use chrono::{DateTime, Utc};
use ongrid_core::image::{ImageReference, ImageState};
use ongrid_core::NodeName;
use sqlx::Row;

use super::{clamp, parse, parse_timestamp, query_with, timestamp, Db, DbRow, SqlStore};
use crate::domain::images::{self, supersedes, ImageChange, ImageRecord};
use crate::store::{ImageDeleted, ImageFilter, NewImage, StoreError, StoreResult};

const IMAGE_COLUMNS: &str = "i.id, i.owner, u.user_name, i.name, i.version, i.state, i.reason, \
     i.session_id, i.session_name, i.node, i.base_image, i.compression, i.digest, i.size, \
     i.sif_path, i.docker_image, i.bytes_done, i.bytes_total, i.progress_at, i.created_at, \
     i.finished_at, i.superseded_at, i.shared_at FROM images i JOIN users u ON u.dn = i.owner";

/// The images a node's desired state names ([`ImageFilter::ForNode`]): `$1` the node, `$2` the
/// time since which removed ones count. Also what [`SqlStore::desired_reads`] asks exists.
macro_rules! for_node_images {
    () => {
        "(i.state = 'BUILDING' AND i.node = $1) OR (i.state = 'DELETED' AND i.finished_at >= $2)"
    };
}
pub(super) use for_node_images;

impl SqlStore {
    pub(super) async fn create_image(&self, new: NewImage) -> StoreResult<ImageRecord> {
        let mut tx = self.write().await?;
        super::refuse_removed(&mut tx, &new.owner).await?;
        let running: Option<(String, String)> = sqlx::query_as(
            "SELECT name, version FROM images WHERE session_id = $1 AND state = 'BUILDING'",
        )
        .bind(new.session_id.to_string())
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((name, version)) = running {
            return Err(StoreError::FreezeRunning {
                session: new.session_name,
                reference: parse(&format!("{name}:{version}"), "image reference")?,
            });
        }
        let current: Option<(String, String)> = sqlx::query_as(
            "SELECT id, state FROM images WHERE owner = $1 AND name = $2 AND version = $3 \
             AND state <> 'DELETED' AND superseded_at IS NULL",
        )
        .bind(new.owner.as_str())
        .bind(new.reference.name())
        .bind(new.reference.version())
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((id, state)) = current {
            let state: ImageState = parse(&state, "image state")?;
            if !supersedes(state, new.force) {
                return Err(StoreError::ImageTagTaken {
                    reference: new.reference,
                    state,
                });
            }
            sqlx::query("UPDATE images SET superseded_at = $1 WHERE id = $2")
                .bind(timestamp(new.at))
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(
            "INSERT INTO images (id, owner, name, version, state, reason, session_id, \
             session_name, node, base_image, compression, progress_at, created_at) \
             VALUES ($1, $2, $3, $4, 'BUILDING', $5, $6, $7, $8, $9, $10, $11, $12)",
        )
        .bind(new.id.to_string())
        .bind(new.owner.as_str())
        .bind(new.reference.name())
        .bind(new.reference.version())
        .bind(&new.reason)
        .bind(new.session_id.to_string())
        .bind(new.session_name.as_str())
        .bind(new.node.as_str())
        .bind(&new.base_image)
        .bind(compression_text(new.compression))
        .bind(timestamp(new.at))
        .bind(timestamp(new.at))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.image(new.id)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("image {} vanished", new.id)))
    }

    pub(super) async fn image(&self, id: uuid::Uuid) -> StoreResult<Option<ImageRecord>> {
        let sql = format!("SELECT {IMAGE_COLUMNS} WHERE i.id = $1");
        let row = sqlx::query(&sql)
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(image_from_row).transpose()
    }

    pub(super) async fn images(&self, filter: ImageFilter) -> StoreResult<Vec<ImageRecord>> {
        read_images(&self.pool, filter).await
    }

    pub(super) async fn set_image_shared(
        &self,
        id: uuid::Uuid,
        shared_at: Option<DateTime<Utc>>,
    ) -> StoreResult<Option<ImageRecord>> {
        let done =
            sqlx::query("UPDATE images SET shared_at = $1 WHERE id = $2 AND state <> 'DELETED'")
                .bind(shared_at.map(timestamp))
                .bind(id.to_string())
                .execute(self.writes())
                .await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        self.image(id).await
    }

    pub(super) async fn record_freeze(
        &self,
        node: &NodeName,
        id: uuid::Uuid,
        change: &ImageChange,
        at: DateTime<Utc>,
    ) -> StoreResult<Option<ImageRecord>> {
        let mut tx = self.write().await?;
        let building: Option<i64> = sqlx::query_scalar(
            "SELECT CAST(1 AS BIGINT) FROM images WHERE id = $1 AND node = $2 AND state = 'BUILDING'",
        )
        .bind(id.to_string())
        .bind(node.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        if building.is_none() {
            return Ok(None);
        }
        match change {
            ImageChange::Progress {
                bytes_done,
                bytes_total,
            } => {
                // The right-hand sides see the row as it was: progress_at moves only when the
                // numbers do.
                sqlx::query(
                    "UPDATE images SET progress_at = CASE WHEN bytes_done <> $1 OR bytes_total <> $2 \
                     THEN $3 ELSE progress_at END, bytes_done = $4, bytes_total = $5 WHERE id = $6",
                )
                .bind(clamp(*bytes_done))
                .bind(clamp(*bytes_total))
                .bind(timestamp(at))
                .bind(clamp(*bytes_done))
                .bind(clamp(*bytes_total))
                .bind(id.to_string())
                    .execute(&mut *tx)
                    .await?;
            }
            ImageChange::Ready {
                reason,
                digest,
                size,
                sif_path,
                docker_image,
            } => {
                sqlx::query(
                    "UPDATE images SET state = $1, reason = $2, digest = $3, size = $4, \
                     sif_path = $5, docker_image = $6, bytes_done = bytes_total, finished_at = $7 \
                     WHERE id = $8",
                )
                .bind(change.state().as_str())
                .bind(reason)
                .bind(digest)
                .bind(clamp(*size))
                .bind(sif_path)
                .bind(docker_image)
                .bind(timestamp(at))
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
            }
            ImageChange::Failed { reason } => {
                sqlx::query(
                    "UPDATE images SET state = $1, reason = $2, finished_at = $3 WHERE id = $4",
                )
                .bind(change.state().as_str())
                .bind(reason)
                .bind(timestamp(at))
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        self.image(id).await
    }

    pub(super) async fn delete_image(
        &self,
        id: uuid::Uuid,
        at: DateTime<Utc>,
    ) -> StoreResult<Option<ImageDeleted>> {
        let mut tx = self.write().await?;
        let sql = format!("SELECT {IMAGE_COLUMNS} WHERE i.id = $1");
        let row = sqlx::query(&sql)
            .bind(id.to_string())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(mut image) = row.as_ref().map(image_from_row).transpose()? else {
            return Ok(None);
        };
        let Some(deletion) = images::delete(&image, at) else {
            return Ok(None);
        };
        sqlx::query("UPDATE images SET state = $1, finished_at = $2, reason = $3 WHERE id = $4")
            .bind(ImageState::Deleted.as_str())
            .bind(timestamp(deletion.at))
            .bind(&deletion.reason)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        image.state = ImageState::Deleted;
        image.finished_at = Some(deletion.at);
        image.reason = deletion.reason;
        let digest_unreferenced = match &image.digest {
            Some(digest) => {
                let others: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM images WHERE digest = $1 AND state <> 'DELETED'",
                )
                .bind(digest)
                .fetch_one(&mut *tx)
                .await?;
                others == 0
            }
            None => false,
        };
        tx.commit().await?;
        Ok(Some(ImageDeleted {
            image,
            digest_unreferenced,
        }))
    }
}

fn compression_text(compression: ongrid_core::image::Compression) -> &'static str {
    match compression {
        ongrid_core::image::Compression::Gzip => "gzip",
        ongrid_core::image::Compression::Zstd => "zstd",
    }
}

fn image_from_row(row: &DbRow) -> StoreResult<ImageRecord> {
    let text = |column: &str| row.try_get::<String, _>(column);
    let optional_text = |column: &str| row.try_get::<Option<String>, _>(column);
    let count = |column: &str| -> StoreResult<u64> {
        let value: i64 = row.try_get(column)?;
        u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("{column} {value} < 0")))
    };
    let optional_time = |column: &str| -> StoreResult<Option<DateTime<Utc>>> {
        optional_text(column)?
            .as_deref()
            .map(parse_timestamp)
            .transpose()
    };
    let id = text("id")?;
    let reference = format!("{}:{}", text("name")?, text("version")?);
    let compression: ongrid_core::image::Compression =
        serde_json::from_value(serde_json::Value::String(text("compression")?))
            .map_err(|e| StoreError::Corrupt(format!("compression of image {id}: {e}")))?;
    let size: Option<i64> = row.try_get("size")?;
    Ok(ImageRecord {
        id: parse(&id, "image id")?,
        owner: parse(&text("owner")?, "owner DN")?,
        user_name: parse(&text("user_name")?, "user name")?,
        reference: parse(&reference, "image reference")?,
        state: parse(&text("state")?, "image state")?,
        reason: text("reason")?,
        session_id: parse(&text("session_id")?, "session id")?,
        session_name: parse(&text("session_name")?, "session name")?,
        node: parse(&text("node")?, "node name")?,
        base_image: text("base_image")?,
        compression,
        digest: optional_text("digest")?,
        size: size
            .map(|s| u64::try_from(s).map_err(|_| StoreError::Corrupt(format!("size {s} < 0"))))
            .transpose()?,
        sif_path: optional_text("sif_path")?,
        docker_image: optional_text("docker_image")?,
        bytes_done: count("bytes_done")?,
        bytes_total: count("bytes_total")?,
        progress_at: parse_timestamp(&text("progress_at")?)?,
        created_at: parse_timestamp(&text("created_at")?)?,
        finished_at: optional_time("finished_at")?,
        superseded_at: optional_time("superseded_at")?,
        shared_at: optional_time("shared_at")?,
    })
}

/// [`crate::store::Store::images`] on `executor` (the pool, or a connection a read holds).
pub(super) async fn read_images<'e, E>(
    executor: E,
    filter: ImageFilter,
) -> StoreResult<Vec<ImageRecord>>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let live = "i.state <> 'DELETED'";
    // The current image of a tag of the user whose `column` is `who`.
    let current_tag = |column: &str, who: String, reference: &ImageReference| {
        (
            format!(
                "{live} AND i.superseded_at IS NULL AND {column} = $1 AND i.name = $2 \
                 AND i.version = $3"
            ),
            vec![
                who,
                reference.name().to_owned(),
                reference.version().to_owned(),
            ],
        )
    };
    let (condition, values): (String, Vec<String>) = match filter {
        ImageFilter::Owner(owner) => (format!("{live} AND i.owner = $1"), vec![owner.to_string()]),
        ImageFilter::All => (live.to_owned(), Vec::new()),
        ImageFilter::Tag { owner, reference } => {
            current_tag("i.owner", owner.to_string(), &reference)
        }
        ImageFilter::LoginTag {
            user_name,
            reference,
        } => current_tag("u.user_name", user_name.to_string(), &reference),
        ImageFilter::Shared => (format!("{live} AND i.shared_at IS NOT NULL"), Vec::new()),
        ImageFilter::Digest {
            owner: Some(owner),
            digest,
        } => (
            format!("{live} AND i.digest = $1 AND i.owner = $2"),
            vec![digest, owner.to_string()],
        ),
        ImageFilter::Digest {
            owner: None,
            digest,
        } => (format!("{live} AND i.digest = $1"), vec![digest]),
        ImageFilter::ForNode {
            node,
            removed_since,
        } => (
            for_node_images!().to_owned(),
            vec![node.to_string(), timestamp(removed_since)],
        ),
        ImageFilter::AllBuilding => ("i.state = 'BUILDING'".to_owned(), Vec::new()),
    };
    let sql = format!("SELECT {IMAGE_COLUMNS} WHERE {condition} ORDER BY i.created_at, i.id");
    let rows = query_with(&sql, values.iter().map(String::as_str))
        .fetch_all(executor)
        .await?;
    rows.iter().map(image_from_row).collect()
}
