//! Grid X.509 identities for ongrid: verification of RFC 3820 proxy chains (and plain user
//! certificates) against a trusted CA directory in IGTF layout, VOMS attributes from the proxy's
//! attribute certificates, and the slash-form DNs the grid names people by.
//!
//! Pure: no network, no clock (the time is in [`VerifyOptions`]), and the only files read are the
//! CA directory and the vomsdir named by the caller ([`CaDir::load`], [`voms::VomsDir::load`]).
//! [`read_ca_dir`] is the one reader of CA directories in ongrid: the gateway and the agents
//! (through `ongrid-service`) and devctl use it too, strictly or leniently ([`CaDirMode`]).
//! The rules and their sources are in `../shared/research/x509_proxies.md` (A.1.2); each rule
//! has its own [`ChainError`] variant. The manager's TLS client verifier and devctl use this
//! crate; `scripts/gridca.sh` makes throwaway credentials for tests.

mod cadir;
mod chain;
mod der;
pub mod dn;
mod pem;
mod sig;
pub mod voms;

pub use cadir::{read_ca_dir, CaCertificate, CaCertificates, CaDir, CaDirError, CaDirMode};
pub use chain::{verify_chain, ChainError, CrlPolicy, ProxyKind, VerifiedChain, VerifyOptions};
pub use der::DerError;
pub use dn::DnError;
pub use pem::{read_pem_chain, PemError};

use ongrid_core::Dn;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The subject of a DER certificate as a slash-form DN (`/DC=org/DC=example/CN=Alice`).
pub fn dn_of(cert_der: &[u8]) -> Result<Dn, DnError> {
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| DnError::BadCertificate(e.to_string()))?;
    dn::name_to_dn(cert.subject())
}

/// The issuer of a DER certificate as a slash-form DN.
pub fn issuer_dn_of(cert_der: &[u8]) -> Result<Dn, DnError> {
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| DnError::BadCertificate(e.to_string()))?;
    dn::name_to_dn(cert.issuer())
}
