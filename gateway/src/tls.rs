//! TLS towards the manager and the node agents: the roots are exactly the CA certificates of
//! `ca_dir` (every `*.0` and `*.pem` file, IGTF layout), never the system's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ongrid_service::pem::{self, CaDirError};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read CA directory {dir}")]
    CaDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read CA file {path}")]
    CaFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CA directory {0} holds no certificate (*.0 or *.pem): put the CA that signed the manager's and the agents' certificates there")]
    NoCa(PathBuf),
    #[error("CA certificate from {path} is not usable")]
    BadCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("building the TLS client configuration")]
    Config(#[source] rustls::Error),
}

pub use ongrid_service::pem::CaCertificate;

impl From<CaDirError> for TlsError {
    fn from(error: CaDirError) -> Self {
        match error {
            CaDirError::Dir { dir, source } => Self::CaDir { dir, source },
            CaDirError::File { path, source } => Self::CaFile { path, source },
            CaDirError::NoCertificate(dir) => Self::NoCa(dir),
        }
    }
}

/// The certificates of every `*.0` and `*.pem` file in `dir` (CRLs `*.r0`, signing policies and
/// other files are skipped).
pub fn load_ca_dir(dir: &Path) -> Result<Vec<CaCertificate>, TlsError> {
    Ok(pem::load_ca_dir(dir)?)
}

/// A rustls client configuration (ring provider) trusting exactly `roots`.
pub fn client_config(roots: &[CaCertificate]) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store
            .add(root.der.clone())
            .map_err(|source| TlsError::BadCa {
                path: root.path.clone(),
                source,
            })?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(TlsError::Config)?
    .with_root_certificates(store)
    .with_no_client_auth();
    Ok(Arc::new(config))
}
