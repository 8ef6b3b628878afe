//! Fuzzes `verify_chain` (and, for chains that verify, `voms::attributes`): the input is a flag
//! byte (bit 0: CRL policy Warn, bit 1: refuse independent proxies) and then certificates, each
//! as a 2-byte big-endian length and that many DER bytes (the last one may be short).
//!
//! The CA directory, vomsdir and time come from ONGRID_FUZZ_CA_DIR, ONGRID_FUZZ_VOMSDIR and
//! ONGRID_FUZZ_NOW (unix seconds), as `x509/fuzz/run.sh` sets them for its seeds made with
//! gridca.sh; without them, the committed test CA `ca.pem` and a fixed time are used.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use chrono::{DateTime, Utc};
use libfuzzer_sys::fuzz_target;
use ongrid_x509::voms::{self, VomsDir};
use ongrid_x509::{read_pem_chain, verify_chain, CaDir, CrlPolicy, VerifyOptions};

struct Setup {
    cas: CaDir,
    vomsdir: VomsDir,
    now: DateTime<Utc>,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let cas = match std::env::var_os("ONGRID_FUZZ_CA_DIR") {
            Some(dir) => CaDir::load(Path::new(&dir)).expect("ONGRID_FUZZ_CA_DIR"),
            None => {
                let (certs, _) = read_pem_chain(include_bytes!("../ca.pem")).expect("ca.pem");
                CaDir::from_parts(Path::new("fuzz/ca.pem"), certs, Vec::new()).expect("ca.pem")
            }
        };
        let vomsdir = std::env::var_os("ONGRID_FUZZ_VOMSDIR")
            .map(|dir| VomsDir::load(&PathBuf::from(dir)).expect("ONGRID_FUZZ_VOMSDIR"))
            .unwrap_or_default();
        let now = std::env::var("ONGRID_FUZZ_NOW")
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .and_then(|s| DateTime::from_timestamp(s, 0))
            .unwrap_or_else(|| DateTime::from_timestamp(1_795_300_000, 0).expect("fixed time"));
        Setup { cas, vomsdir, now }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let mut chain = Vec::new();
    while rest.len() >= 2 && chain.len() < 8 {
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let end = (2 + len).min(rest.len());
        chain.push(rest[2..end].to_vec());
        rest = &rest[end..];
    }
    let setup = setup();
    let opts = VerifyOptions {
        crl_policy: if flags & 1 == 1 {
            CrlPolicy::Warn
        } else {
            CrlPolicy::Refuse
        },
        allow_independent: flags & 2 == 0,
        ..VerifyOptions::at(setup.now)
    };
    match verify_chain(&chain, &setup.cas, &opts) {
        Ok(verified) => {
            assert!(verified.not_after >= setup.now - chrono::Duration::minutes(5));
            let _ = voms::attributes(&verified, &setup.cas, &setup.vomsdir, setup.now);
        }
        Err(e) => {
            // Every error renders.
            let _ = e.to_string();
        }
    }
});
