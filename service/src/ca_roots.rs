//! TLS towards the manager and the node agents, for the gateway (and towards the agents, for
//! the manager's web apps): the roots are exactly the CA certificates of `ca_dir` (IGTF layout,
//! read strictly by [`crate::pem::load_ca_dir`]), never the system's.

use std::path::Path;
use std::sync::Arc;

use crate::pem::{self, CaDirError};

pub use crate::pem::CaCertificate;

/// Why `ca_dir` cannot give its TLS roots.
#[derive(Debug, thiserror::Error)]
pub enum CaRootsError {
    #[error("ca_dir must hold the CAs that signed the manager's and the agents' certificates")]
    CaDir(#[from] CaDirError),
    #[error("CA certificate from {} is not usable as a TLS root", path.display())]
    BadCa {
        path: std::path::PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("building the TLS client configuration")]
    Config(#[source] rustls::Error),
}

/// The CA certificates of `ca_dir`, at least one; a file that cannot be used is an error.
pub fn load_ca_dir(dir: &Path) -> Result<Vec<CaCertificate>, CaRootsError> {
    Ok(pem::load_ca_dir(dir)?)
}

/// A rustls client configuration (ring provider) trusting exactly `roots`.
pub fn client_config(roots: &[CaCertificate]) -> Result<Arc<rustls::ClientConfig>, CaRootsError> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store
            .add(root.der.clone().into())
            .map_err(|source| CaRootsError::BadCa {
                path: root.path.clone(),
                source,
            })?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(CaRootsError::Config)?
    .with_root_certificates(store)
    .with_no_client_auth();
    Ok(Arc::new(config))
}
