//! The rules of [`Tokenizer::from_spec`] (one test per rule, asserting its message), the
//! SentencePiece merge order on hand-worked vocabularies, and the streaming decoder.

use proptest::prelude::*;

use super::*;

fn strings(tokens: &[&str]) -> Vec<String> {
    tokens.iter().map(|t| t.to_string()).collect()
}

/// A byte-level vocabulary: the printable ASCII bytes, "ab", a space token, two control tokens.
fn bpe_spec() -> TokenizerSpec {
    let chars = byte_level_chars();
    let mut tokens: Vec<String> = (b'a'..=b'e').map(|b| chars[b as usize].to_string()).collect(); // 0..=4
    tokens.push("ab".to_string()); // 5
    tokens.push(chars[b' ' as usize].to_string()); // 6: Ġ
    tokens.push("<|im_start|>".to_string()); // 7
    tokens.push("<|im_end|>".to_string()); // 8
    let mut spec = TokenizerSpec::new(TokenizerModel::Gpt2, tokens);
    spec.merges = Some(vec!["a b".to_string()]);
    spec.pre = Some("gpt-2".to_string());
    spec.token_types = Some(vec![1, 1, 1, 1, 1, 1, 1, 3, 3]);
    spec.bos_id = Some(7);
    spec.eos_id = Some(8);
    spec
}

/// A SentencePiece vocabulary whose merges are worked out by hand in the tests below.
fn spm_spec() -> TokenizerSpec {
    let mut tokens = strings(&["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab", "c", "bc"]);
    let mut scores = vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5, -0.2, -0.1, -4.0, -0.05];
    let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1];
    for byte in [0xC3u8, 0xA9] {
        tokens.push(format!("<0x{byte:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    let mut spec = TokenizerSpec::new(TokenizerModel::Llama, tokens);
    spec.scores = Some(scores);
    spec.token_types = Some(types);
    spec.bos_id = Some(1);
    spec.eos_id = Some(2);
    spec.unk_id = Some(0);
    spec
}

fn reason(result: Result<Tokenizer>) -> String {
    match result {
        Ok(_) => panic!("expected a tokenizer error, got a tokenizer"),
        Err(Error::Tokenizer { reason }) => reason,
        Err(other) => panic!("expected Error::Tokenizer, got {other:?}"),
    }
}

#[test]
fn bpe_merges_and_matches_special_tokens_whole() -> Result<()> {
    let t = Tokenizer::from_spec(bpe_spec())?;
    assert_eq!(t.encode("ab a", false)?, vec![5, 6, 0]);
    assert_eq!(t.encode("<|im_start|>abc<|im_end|>", false)?, vec![7, 5, 2, 8]);
    // Without add_bos in the spec, add_special adds nothing.
    assert_eq!(t.encode("a", true)?, vec![0]);
    assert_eq!(t.decode(&[7, 5, 6, 0, 8])?, "<|im_start|>ab a<|im_end|>");
    assert_eq!(t.eos_ids(), &[8]);
    assert!(t.is_special(7) && !t.is_special(5));
    Ok(())
}

#[test]
fn bpe_adds_bos_and_eos_when_asked() -> Result<()> {
    let mut spec = bpe_spec();
    spec.add_bos = true;
    spec.add_eos = true;
    let t = Tokenizer::from_spec(spec)?;
    assert_eq!(t.encode("a", true)?, vec![7, 0, 8]);
    assert_eq!(t.encode("a", false)?, vec![0]);
    Ok(())
}

#[test]
fn bpe_refuses_text_with_a_byte_that_has_no_token() -> Result<()> {
    let t = Tokenizer::from_spec(bpe_spec())?;
    let message = t.encode("az", false).map(|_| ()).map_err(|e| e.to_string());
    assert_eq!(
        message,
        Err("tokenizer: the text has 2 bytes but its tokens cover 1: the vocabulary lacks a token for some \
             of its bytes"
            .to_string())
    );
    Ok(())
}

#[test]
fn sentencepiece_merges_by_score() -> Result<()> {
    let t = Tokenizer::from_spec(spm_spec())?;
    // "▁ab": candidates ▁a (-0.5) and ab (-0.2); ab first, then ▁+ab = ▁ab (-0.1).
    assert_eq!(t.encode("ab", false)?, vec![8]);
    // "▁abc": ab (-0.2) vs bc (-0.05): bc wins, then ▁a (-0.5); "▁a"+"bc" is no token.
    assert_eq!(t.encode("abc", false)?, vec![6, 10]);
    // BOS and the space prefix by default; a space inside the text is ▁.
    assert_eq!(t.encode("a ab", true)?, vec![1, 6, 8]);
    assert_eq!(t.decode(&[6, 8])?, "a ab");
    assert_eq!(t.decode(&[1, 6, 8])?, "<s> a ab");
    Ok(())
}

#[test]
fn sentencepiece_falls_back_to_bytes_and_to_unknown() -> Result<()> {
    let t = Tokenizer::from_spec(spm_spec())?;
    // é is C3 A9, both byte tokens; z has no byte token, so the unknown token.
    assert_eq!(t.encode("é", false)?, vec![3, 11, 12]);
    assert_eq!(t.encode("z", false)?, vec![3, 0]);
    assert_eq!(t.decode(&[3, 11, 12])?, "é");
    let mut spec = spm_spec();
    spec.unk_id = None;
    let t = Tokenizer::from_spec(spec)?;
    let err = t.encode("z", false).map(|_| ()).map_err(|e| e.to_string());
    assert_eq!(
        err,
        Err(
            "tokenizer: byte 0x7A has no token: the vocabulary has no byte token <0x7A> and no unknown token"
                .to_string()
        )
    );
    Ok(())
}

#[test]
fn sentencepiece_special_tokens_split_the_text_and_reset_the_space_prefix() -> Result<()> {
    let t = Tokenizer::from_spec(spm_spec())?;
    // As llama.cpp: a space prefix before the text and after each special token.
    assert_eq!(t.encode("ab</s>ab", false)?, vec![8, 2, 8]);
    Ok(())
}

#[test]
fn stream_holds_back_a_split_character() -> Result<()> {
    let t = Tokenizer::from_spec(spm_spec())?;
    let mut stream = t.stream();
    assert_eq!(stream.step(6)?, "a"); // the leading space of the first token is dropped
    assert_eq!(stream.step(11)?, "");
    assert_eq!(stream.step(12)?, "é");
    assert_eq!(stream.step(8)?, " ab");
    assert_eq!(stream.finish(), "");
    Ok(())
}

#[test]
fn stream_replaces_impossible_bytes_and_flushes_a_cut_character() -> Result<()> {
    let t = Tokenizer::from_spec(spm_spec())?;
    let mut stream = t.stream();
    // A9 alone can never start a character.
    assert_eq!(stream.step(12)?, "\u{FFFD}");
    assert_eq!(stream.step(11)?, "");
    assert_eq!(stream.finish(), "\u{FFFD}");
    Ok(())
}

#[test]
fn decode_refuses_ids_out_of_range_and_bytes_that_are_not_utf8() -> Result<()> {
    let t = Tokenizer::from_spec(spm_spec())?;
    assert_eq!(
        t.decode(&[3, 13]).map_err(|e| e.to_string()),
        Err("tokenizer: token id 13 is out of range: the vocabulary has 13 tokens".to_string())
    );
    assert_eq!(
        t.decode(&[4, 11]).map_err(|e| e.to_string()),
        Err("tokenizer: 2 ids decode to bytes that are not UTF-8 (invalid from byte 1)".to_string())
    );
    Ok(())
}

#[test]
fn rule_empty_vocabulary() {
    let spec = TokenizerSpec::new(TokenizerModel::Gpt2, vec![]);
    assert_eq!(reason(Tokenizer::from_spec(spec)), "the vocabulary (tokenizer.ggml.tokens) is empty");
}

#[test]
fn rule_scores_length() {
    let mut spec = spm_spec();
    spec.scores = Some(vec![0.0; 3]);
    assert_eq!(
        reason(Tokenizer::from_spec(spec)),
        "tokenizer.ggml.scores has 3 entries but there are 13 tokens"
    );
}

#[test]
fn rule_token_type_length() {
    let mut spec = spm_spec();
    spec.token_types = Some(vec![1; 14]);
    assert_eq!(
        reason(Tokenizer::from_spec(spec)),
        "tokenizer.ggml.token_type has 14 entries but there are 13 tokens"
    );
}

#[test]
fn rule_unknown_token_type() {
    let mut spec = bpe_spec();
    spec.token_types = Some(vec![1, 1, 9, 1, 1, 1, 1, 3, 3]);
    assert_eq!(reason(Tokenizer::from_spec(spec)), "token 2 has token type 9; known types are 0 to 6");
}

#[test]
fn rule_special_id_out_of_range() {
    let mut spec = bpe_spec();
    spec.eos_id = Some(9);
    assert_eq!(
        reason(Tokenizer::from_spec(spec)),
        "eos token id 9 is out of range: the vocabulary has 9 tokens"
    );
}

#[test]
fn rule_duplicate_token() {
    let mut spec = bpe_spec();
    spec.tokens[4] = "a".to_string();
    assert_eq!(reason(Tokenizer::from_spec(spec)), "token `a` appears twice, at ids 0 and 4");
}

#[test]
fn rule_merges_required_for_byte_level_bpe() {
    let mut spec = bpe_spec();
    spec.merges = None;
    assert_eq!(
        reason(Tokenizer::from_spec(spec)),
        "a byte-level BPE vocabulary needs tokenizer.ggml.merges, which is missing"
    );
}

#[test]
fn rule_merge_without_separator() {
    let mut spec = bpe_spec();
    spec.merges = Some(vec!["ab".to_string()]);
    assert_eq!(reason(Tokenizer::from_spec(spec)), "merge 0 `ab` is not two tokens separated by a space");
}

#[test]
fn rule_merge_of_unknown_token() {
    let mut spec = bpe_spec();
    spec.merges = Some(vec!["a b".to_string(), "a zz".to_string()]);
    assert_eq!(reason(Tokenizer::from_spec(spec)), "merge 1 `a zz` names `zz`, which is not a token");
}

#[test]
fn rule_merge_result_not_a_token() {
    let mut spec = bpe_spec();
    spec.merges = Some(vec!["b c".to_string()]);
    assert_eq!(reason(Tokenizer::from_spec(spec)), "merge 0 `b c` makes `bc`, which is not a token");
}

#[test]
fn rule_unknown_pre_tokenizer() {
    let mut spec = bpe_spec();
    spec.pre = Some("nonesuch".to_string());
    assert!(reason(Tokenizer::from_spec(spec)).starts_with(
        "pre-tokenizer `nonesuch` (tokenizer.ggml.pre) is not one Kiln knows; known: default, "
    ));
}

#[test]
fn rule_unknown_model() {
    let err = TokenizerModel::from_gguf_name("bert").map_err(|e| e.to_string());
    assert_eq!(
        err,
        Err("tokenizer: tokenizer model `bert` (tokenizer.ggml.model) is not served; Kiln serves \"gpt2\" and \
             \"llama\""
            .to_string())
    );
}

#[test]
fn rule_malformed_byte_token() {
    for bad in ["<0x-1>", "<0x1>", "<0xGG>", "<0x100>"] {
        let mut spec = spm_spec();
        spec.tokens[11] = bad.to_string();
        assert_eq!(
            reason(Tokenizer::from_spec(spec)),
            format!("byte token 11 is `{bad}`, not of the form <0xNN>")
        );
    }
}

#[test]
fn byte_level_table_is_gpt2s() {
    let chars = byte_level_chars();
    assert_eq!(chars[b' ' as usize], 'Ġ');
    assert_eq!(chars[b'\n' as usize], 'Ċ');
    assert_eq!(chars[0], 'Ā');
    // The 68th and last byte outside the printable ranges: U+0100 + 67.
    assert_eq!(chars[0xAD], '\u{143}');
    assert_eq!(chars[b'A' as usize], 'A');
    let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
    assert_eq!(distinct.len(), 256);
}

fn arbitrary_spec() -> impl Strategy<Value = TokenizerSpec> {
    let token = prop::string::string_regex("(<0x[-0-9A-Fa-f]{0,3}>|[ab ▁Ġé<>|]{0,4})")
        .unwrap_or_else(|_| unreachable!());
    (
        prop::collection::vec(token, 0..12),
        any::<bool>(),
        prop::option::of(prop::collection::vec(-1i32..8, 0..12)),
        prop::option::of(prop::collection::vec(any::<f32>(), 0..12)),
        prop::option::of(prop::collection::vec("[ab Ġ]{0,5}", 0..6)),
        prop::option::of(0u32..14),
        prop::sample::select(vec!["gpt-2", "llama-bpe", "qwen2", "smollm", "default", "bogus"]),
    )
        .prop_map(|(tokens, llama, types, scores, merges, eos, pre)| {
            let model = if llama { TokenizerModel::Llama } else { TokenizerModel::Gpt2 };
            let mut spec = TokenizerSpec::new(model, tokens);
            spec.token_types = types;
            spec.scores = scores;
            spec.merges = merges;
            spec.eos_id = eos;
            spec.pre = Some(pre.to_string());
            spec
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any spec either builds or is refused; a built one encodes and decodes anything without
    /// panicking.
    #[test]
    fn arbitrary_specs_never_panic(spec in arbitrary_spec(), text in "[ab ▁é<>|0-9\\n]{0,16}", ids in prop::collection::vec(0u32..20, 0..8)) {
        if let Ok(t) = Tokenizer::from_spec(spec) {
            let _ = t.encode(&text, true);
            let _ = t.decode(&ids);
            let mut stream = t.stream();
            for &id in &ids {
                let _ = stream.step(id);
            }
            let _ = stream.finish();
        }
    }

    /// Decoding arbitrary ids never panics, and a stream emits the same text as a decode
    /// whenever the decode succeeds.
    #[test]
    fn stream_agrees_with_decode(ids in prop::collection::vec(0u32..14, 0..24)) {
        let t = Tokenizer::from_spec(spm_spec()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let decoded = t.decode(&ids);
        let mut stream = t.stream();
        let mut streamed = String::new();
        let mut failed = false;
        for &id in &ids {
            match stream.step(id) {
                Ok(text) => streamed.push_str(&text),
                Err(_) => failed = true,
            }
        }
        streamed.push_str(&stream.finish());
        if let Ok(text) = decoded {
            prop_assert!(!failed);
            prop_assert_eq!(streamed, text);
        }
    }

    /// Encoding then decoding gives the text back (every character of the alphabet has a token
    /// or byte tokens).
    #[test]
    fn sentencepiece_round_trips(text in "[abcé]{1,12}( [abcé]{1,6}){0,3}") {
        let t = Tokenizer::from_spec(spm_spec()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let ids = t.encode(&text, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(t.decode(&ids).map_err(|e| TestCaseError::fail(e.to_string()))?, text);
    }
}
