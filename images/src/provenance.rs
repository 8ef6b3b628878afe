//! What a frozen image records of where it came from and how it runs: the session image's
//! configuration, its provenance, and the JSON metadata object of the SIF that holds both.

use chrono::{DateTime, Utc};
use ongrid_core::image::Compression;

/// Name of the JSON metadata object in the SIF.
pub const PROVENANCE_OBJECT: &str = "ongrid-provenance.json";

/// The parts of the session image's configuration that shape how the frozen image runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageConfig {
    /// `KEY=value` as in Docker's `Config.Env`.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// Docker's `Config.User`; recorded only (Apptainer runs as the calling user).
    pub user: Option<String>,
}

/// Where the frozen image came from; recorded in the SIF's definition file, JSON metadata and
/// labels.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Provenance {
    /// The owner's DN.
    pub owner: String,
    /// The session's name.
    pub session: String,
    pub base_image: String,
    /// `name:version`.
    pub reference: String,
    pub created_at: DateTime<Utc>,
}

/// The JSON metadata object (`ongrid-provenance.json`) of every frozen image.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProvenanceRecord {
    pub format: String,
    #[serde(flatten)]
    pub provenance: Provenance,
    /// `sha256:<hex>` of the squashfs partition.
    pub squashfs_digest: String,
    pub compression: Compression,
    pub config: ImageConfig,
    pub freeze: serde_json::Value,
    pub tool: String,
}
