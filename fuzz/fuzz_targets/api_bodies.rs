//! Fuzzes the JSON request bodies of the manager's API (`ongrid_core::api`, `::lifecycle`,
//! `::image`, `::job`): each input is tried as every request type, and what is accepted goes
//! through the checks the handlers apply before touching the store (GPU request, image name,
//! lifecycle limits, SSH public keys, stream URLs, job specs).
//!
//! Properties: nothing panics; every refusal renders; an accepted body serialises into JSON
//! that parses back to the same value (what devctl, the agents and the gateway send is what the
//! manager reads).
#![no_main]

use std::fmt::Debug;
use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ongrid_core::api::{
    AddKey, ConnectionEvent, CreateSession, Institute, KeyCheck, NodeReport, RegisterNode,
    RouteRequest, SetGpuMode,
};
use ongrid_core::holds::{HoldRequest, KeepRequest};
use ongrid_core::image::CreateImage;
use ongrid_core::job::JobSpec;
use ongrid_manager::app::agent_sync::check_stream_url;
use ongrid_manager::config::check_image;
use ongrid_manager::domain::sessions::holds::LifecycleConfig;
use ongrid_manager::keys::{fingerprint_of, SshPublicKey};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The lifecycle rules of the example manager config.
fn lifecycle() -> &'static LifecycleConfig {
    static LIFECYCLE: OnceLock<LifecycleConfig> = OnceLock::new();
    LIFECYCLE.get_or_init(|| {
        let text = include_str!("../../deploy/examples/manager.toml");
        ongrid_manager::Config::from_toml(text, Path::new("manager.toml"), |_| None)
            .expect("deploy/examples/manager.toml is valid")
            .lifecycle
    })
}

/// `Some(body)` when `data` is a `T`, after checking that it survives a JSON round trip.
fn body<T: Serialize + DeserializeOwned + PartialEq + Debug>(data: &[u8]) -> Option<T> {
    match serde_json::from_slice::<T>(data) {
        Ok(value) => {
            let json = serde_json::to_vec(&value).expect("serialise an accepted body");
            let back: T = serde_json::from_slice(&json).unwrap_or_else(|error| {
                panic!(
                    "{} does not read its own JSON {:?}: {error}",
                    std::any::type_name::<T>(),
                    String::from_utf8_lossy(&json)
                )
            });
            assert_eq!(back, value, "{}", String::from_utf8_lossy(&json));
            Some(value)
        }
        Err(error) => {
            let _ = error.to_string();
            None
        }
    }
}

fn refusal(result: Result<impl Sized, impl ToString>) {
    if let Err(error) = result {
        let _ = error.to_string();
    }
}

fuzz_target!(|data: &[u8]| {
    if let Some(create) = body::<CreateSession>(data) {
        refusal(create.gpus.validate());
        if let Some(image) = &create.image {
            refusal(check_image(image.trim()));
        }
        refusal(lifecycle().limits_for(create.idle_timeout_secs, create.max_duration_secs));
    }
    let _ = body::<SetGpuMode>(data);
    if let Some(register) = body::<RegisterNode>(data) {
        if let Some(url) = &register.stream_url {
            refusal(check_stream_url(url));
        }
    }
    let _ = body::<NodeReport>(data);
    if let Some(add) = body::<AddKey>(data) {
        if SshPublicKey::parse_for_registration(&add.public_key).is_ok() {
            // A key accepted for registration has a fingerprint.
            fingerprint_of(&add.public_key)
                .unwrap_or_else(|e| panic!("registered key without fingerprint: {e}"));
        }
    }
    if let Some(check) = body::<KeyCheck>(data) {
        refusal(fingerprint_of(&check.public_key));
    }
    let _ = body::<RouteRequest>(data);
    let _ = body::<ConnectionEvent>(data);
    let _ = body::<Institute>(data);
    let _ = body::<HoldRequest>(data);
    let _ = body::<KeepRequest>(data);
    let _ = body::<CreateImage>(data);
    if let Some(spec) = body::<JobSpec>(data) {
        spec.check()
            .expect("a JobSpec from serde passed its checks");
    }
});
