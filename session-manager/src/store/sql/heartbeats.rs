//! Heartbeats written together ([`super::sync_records`]): the `last_seen` of every node whose
//! sync arrives while a write of the syncs' records waits for the writer goes in that write, one
//! `UPDATE` for all.
//!
//! Every node's agent syncs every `sync_interval` (5 s by default), and more often while its
//! jobs end: on a site of 1,000 nodes that is hundreds of heartbeats a second, each of them a
//! commit on SQLite's one writer (where the creates, submits and rounds wait their turn) and a
//! commit of its own on PostgreSQL.

use std::collections::{BTreeMap, HashSet};

use chrono::{DateTime, Utc};
use ongrid_core::NodeName;
use sqlx::{QueryBuilder, Transaction};

use super::{timestamp, Db};
use crate::store::StoreResult;

/// A node seen at `at`.
#[derive(Debug)]
pub struct Beat {
    pub(super) node: NodeName,
    at: DateTime<Utc>,
}

impl Beat {
    pub(super) fn new(node: &NodeName, at: DateTime<Utc>) -> Self {
        Self {
            node: node.clone(),
            at,
        }
    }
}

/// Writes `beats` in one statement in `tx`: the names of the nodes updated (those registered).
/// A node that beats twice in one write is seen at the later of the two.
pub(super) async fn write_beats(
    tx: &mut Transaction<'static, Db>,
    beats: &[&Beat],
) -> StoreResult<HashSet<String>> {
    let mut latest: BTreeMap<&NodeName, DateTime<Utc>> = BTreeMap::new();
    for beat in beats {
        let at = latest.entry(&beat.node).or_insert(beat.at);
        *at = (*at).max(beat.at);
    }
    let mut query = QueryBuilder::<Db>::new("WITH beats (name, seen) AS (");
    query.push_values(&latest, |mut row, (node, at)| {
        row.push_bind(node.as_str()).push_bind(timestamp(*at));
    });
    query.push(
        ") UPDATE nodes SET last_seen = beats.seen FROM beats \
         WHERE nodes.name = beats.name AND nodes.removed_at IS NULL RETURNING nodes.name",
    );
    // A statement of the batch's length: kept out of the statement cache but for one.
    let updated = query
        .build_query_scalar()
        .persistent(latest.len() == 1)
        .fetch_all(&mut **tx)
        .await?
        .into_iter()
        .collect();
    Ok(updated)
}
