//! `docs/config-reference.md` against [`super::ConfigFile`]: its agent examples name every key
//! of the agent's config file and no other (see `ongrid_service::config_reference`).

use ongrid_service::config_reference::{check, toml_blocks};

use super::ConfigFile;

#[test]
fn the_reference_names_every_key_of_the_agent_and_no_other() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/config-reference.md");
    let reference = std::fs::read_to_string(path).expect("docs/config-reference.md");
    let blocks = toml_blocks(&reference, "agent");
    assert_eq!(
        blocks.len(),
        2,
        "the full example and the simulated [gpu] one"
    );
    if let Err(mismatch) = check::<ConfigFile>(&blocks[0]) {
        panic!("docs/config-reference.md, agent: {mismatch}");
    }
    // `[gpu]` is an internally tagged enum, which serde reads out of sight: both backends'
    // keys are at least known.
    for block in &blocks {
        if let Err(e) = toml::from_str::<ConfigFile>(block) {
            panic!("docs/config-reference.md, agent: {e}");
        }
    }
}
