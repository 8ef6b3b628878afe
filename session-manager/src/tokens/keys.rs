//! An issuer's signing keys: its JWK set, read from the site's file or fetched through the
//! issuer's OpenID discovery document, cached, and read again when a token names a key the cache
//! does not hold (the issuer rotated its keys), when the cache is older than [`KEYS_TTL`], or
//! when the file changed.
//!
//! A refetch for an unknown key happens at most once per [`REFETCH_GAP`], so that tokens naming
//! made-up keys cannot make the manager hammer the issuer. A failed refresh keeps the keys it
//! had (and logs why); with none, the token is refused naming the cause.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde::Deserialize;
use tokio::sync::Mutex;

use crate::config::tokens::KeySource;

/// How long fetched keys are used before they are fetched again.
pub const KEYS_TTL: Duration = Duration::from_secs(3600);
/// The least time between two fetches caused by tokens naming unknown keys.
pub const REFETCH_GAP: Duration = Duration::from_secs(30);
/// The most a discovery document or a JWK set may weigh.
const MAX_DOCUMENT: usize = 1 << 20;
/// How long a fetch from the issuer may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Why no key could be found for a token.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KeyError {
    #[error("the issuer's keys cannot be read: {0}")]
    Unavailable(String),
    #[error("the issuer has no key {kid:?} (its keys: {known}); a token signed by another key, or by a key it has retired, is refused")]
    Unknown { kid: String, known: String },
    #[error("the token names no key (kid) and the issuer has {0} keys: the manager cannot tell which one signed it")]
    NoKeyId(usize),
}

/// The keys of one issuer.
pub struct IssuerKeys {
    issuer: String,
    source: Source,
    cache: Mutex<Cache>,
}

enum Source {
    File(PathBuf),
    Discovery(reqwest::Client),
}

#[derive(Default)]
struct Cache {
    keys: Option<Arc<JwkSet>>,
    /// When `keys` were read.
    read_at: Option<Instant>,
    /// The file's modification time when it was read.
    file_modified: Option<SystemTime>,
    /// The last refresh a token's unknown key caused.
    refetched_at: Option<Instant>,
}

#[derive(Deserialize)]
struct DiscoveryDocument {
    jwks_uri: String,
}

impl IssuerKeys {
    /// The keys of `issuer`, read from `source` when first needed. Fails when the CA file of a
    /// discovery source cannot be read.
    pub fn new(issuer: &str, source: &KeySource) -> Result<Self, String> {
        let source = match source {
            KeySource::File(path) => Source::File(path.clone()),
            KeySource::Discovery { ca_file } => Source::Discovery(https_client(ca_file)?),
        };
        Ok(Self {
            issuer: issuer.to_owned(),
            source,
            cache: Mutex::new(Cache::default()),
        })
    }

    /// The key `kid` (or the only key, for a token that names none).
    pub async fn key(&self, kid: Option<&str>) -> Result<Jwk, KeyError> {
        let mut cache = self.cache.lock().await;
        if self.stale(&cache) {
            self.refresh(&mut cache).await?;
        }
        if let Some(found) = find(cache.keys.as_deref(), kid)? {
            return Ok(found);
        }
        let may_refetch = cache
            .refetched_at
            .is_none_or(|at| at.elapsed() >= REFETCH_GAP);
        if may_refetch {
            cache.refetched_at = Some(Instant::now());
            self.refresh(&mut cache).await?;
            if let Some(found) = find(cache.keys.as_deref(), kid)? {
                return Ok(found);
            }
        }
        Err(KeyError::Unknown {
            kid: kid.unwrap_or_default().to_owned(),
            known: known_ids(cache.keys.as_deref()),
        })
    }

    fn stale(&self, cache: &Cache) -> bool {
        let Some(read_at) = cache.read_at else {
            return true;
        };
        match &self.source {
            Source::File(path) => modified(path) != cache.file_modified,
            Source::Discovery(_) => read_at.elapsed() >= KEYS_TTL,
        }
    }

    /// Reads the keys again; keeps the old ones when that fails and there are some.
    async fn refresh(&self, cache: &mut Cache) -> Result<(), KeyError> {
        let read = match &self.source {
            Source::File(path) => read_file(path).map(|set| (set, modified(path))),
            Source::Discovery(client) => fetch(client, &self.issuer).await.map(|set| (set, None)),
        };
        match read {
            Ok((set, file_modified)) => {
                tracing::info!(issuer = %self.issuer, keys = %known_ids(Some(&set)), "Token issuer's keys read.");
                cache.keys = Some(Arc::new(set));
                cache.read_at = Some(Instant::now());
                cache.file_modified = file_modified;
                Ok(())
            }
            Err(cause) if cache.keys.is_some() => {
                tracing::warn!(issuer = %self.issuer, %cause, "Cannot read the token issuer's keys again; the ones read before stay in use.");
                // Not again at once: the old keys serve until the next refresh is due.
                cache.read_at = Some(Instant::now());
                Ok(())
            }
            Err(cause) => {
                tracing::warn!(issuer = %self.issuer, %cause, "Cannot read the token issuer's keys.");
                Err(KeyError::Unavailable(cause))
            }
        }
    }
}

/// The key named `kid` in `set`; without a `kid`, the set's only key.
fn find(set: Option<&JwkSet>, kid: Option<&str>) -> Result<Option<Jwk>, KeyError> {
    let Some(set) = set else {
        return Ok(None);
    };
    match kid {
        Some(kid) => Ok(set.find(kid).cloned()),
        None if set.keys.len() == 1 => Ok(set.keys.first().cloned()),
        None => Err(KeyError::NoKeyId(set.keys.len())),
    }
}

fn known_ids(set: Option<&JwkSet>) -> String {
    let ids: Vec<&str> = set
        .map(|set| {
            set.keys
                .iter()
                .map(|key| key.common.key_id.as_deref().unwrap_or("(no kid)"))
                .collect()
        })
        .unwrap_or_default();
    if ids.is_empty() {
        "none".to_owned()
    } else {
        ids.join(", ")
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn read_file(path: &Path) -> Result<JwkSet, String> {
    let text = std::fs::read(path)
        .map_err(|e| format!("cannot read the JWK set file {}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| {
        format!(
            "{} is not a JWK set ({{\"keys\": [...]}}, as the issuer's jwks_uri serves it): {e}",
            path.display()
        )
    })
}

/// The issuer's JWK set, through its discovery document.
async fn fetch(client: &reqwest::Client, issuer: &str) -> Result<JwkSet, String> {
    let discovery = format!(
        "{}/.well-known/openid-configuration",
        issuer.trim_end_matches('/')
    );
    let document: DiscoveryDocument = get_json(client, &discovery).await?;
    if !document.jwks_uri.starts_with("https://") {
        return Err(format!(
            "{discovery} names jwks_uri {:?}, which is not https: refused",
            document.jwks_uri
        ));
    }
    get_json(client, &document.jwks_uri).await
}

async fn get_json<T: for<'de> Deserialize<'de>>(
    client: &reqwest::Client,
    url: &str,
) -> Result<T, String> {
    let mut response = client
        .get(url)
        .send()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("GET {url}: {}", response.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?
    {
        if body.len() + chunk.len() > MAX_DOCUMENT {
            return Err(format!("GET {url}: the answer is larger than 1 MiB"));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| format!("GET {url}: not the JSON expected: {e}"))
}

/// An https client that trusts the CAs of `ca_file` only, and follows no redirect.
fn https_client(ca_file: &Path) -> Result<reqwest::Client, String> {
    let mut roots = rustls::RootCertStore::empty();
    let certificates = CertificateDer::pem_file_iter(ca_file)
        .map_err(|e| format!("cannot read the CA file {}: {e}", ca_file.display()))?;
    for certificate in certificates {
        let certificate = certificate
            .map_err(|e| format!("the CA file {} is not PEM: {e}", ca_file.display()))?;
        // A bundle may hold certificates this TLS stack does not take; the others still count.
        roots.add(certificate).ok();
    }
    if roots.is_empty() {
        return Err(format!(
            "the CA file {} holds no CA certificate",
            ca_file.display()
        ));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .https_only(true)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(FETCH_TIMEOUT)
        .build()
        .map_err(|e| format!("https client: {e}"))
}
