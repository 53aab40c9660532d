/* cli/cmd_tokenize.c: `ctitan tokenize`: encode text to ids or decode ids to
 * text from the command line, with a Hugging Face tokenizer directory.
 *
 * For checking what the model sees: `--text "Hello world"` prints the ids
 * ("9707 1879" with Qwen3's tokenizer), `--decode --ids "9707 1879"` prints
 * the text back. Encoding adds the special tokens of the tokenizer's
 * template as HF's encode does (Llama 3's <|begin_of_text|>, Mistral's <s>;
 * none for Qwen), unless --no-add-special. `--file F` encodes a whole file (bytes as they are: invalid
 * UTF-8 is repaired as HF does). `--tokens` prints each id with its
 * vocabulary string, one per line. --tokenizer may be a Hugging Face Hub id
 * (at --revision; hub/hub.h). Exit 2 for bad usage, 1 for file errors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fs.h"
#include "cli/args.h"
#include "cli/cli.h"
#include "hub/hub.h"
#include "tokenizer/tokenizer.h"

enum { TK_TOKENIZER, TK_TEXT, TK_FILE, TK_IDS, TK_DECODE, TK_TOKENS, TK_SPECIAL, TK_NO_ADD, TK_REVISION, TK_HELP };
static const cli_opt tk_options[] = {
    [TK_TOKENIZER] = {"--tokenizer", "DIR", "(required)",
                      "directory with tokenizer.json (or vocab.json + merges.txt), or a Hub id (Qwen/Qwen3-0.6B)",
                      CLI_VALUE},
    [TK_TEXT] = {"--text", "TEXT", "", "text to encode", CLI_TEXT},
    [TK_FILE] = {"--file", "PATH", "", "encode the bytes of a file", CLI_VALUE},
    [TK_IDS] = {"--ids", "\"ID ID ...\"", "", "ids to decode (spaces or commas between them)", CLI_TEXT},
    [TK_DECODE] = {"--decode", "", "off", "decode --ids instead of encoding", CLI_FLAG},
    [TK_TOKENS] = {"--tokens", "", "off", "print each id with its vocabulary string, one per line", CLI_FLAG},
    [TK_SPECIAL] = {"--skip-special", "", "off", "decode: leave special tokens out", CLI_FLAG},
    [TK_NO_ADD] = {"--no-add-special", "", "off",
                   "encode: without the special tokens the tokenizer's template adds (<s>, <|begin_of_text|>)",
                   CLI_FLAG},
    [TK_REVISION] = {"--revision", "R", HUB_DEFAULT_REVISION, "branch, tag or commit when --tokenizer is a Hub id",
                     CLI_VALUE},
    [TK_HELP] = {"--help", "", "", "this text", CLI_FLAG},
};

static void cli_tokenize_help(void) {
    printf("usage: ctitan tokenize --tokenizer DIR (--text TEXT | --file PATH) [--tokens] [--no-add-special]\n"
           "       ctitan tokenize --tokenizer DIR --decode --ids \"ID ID ...\" [--skip-special]\n\n"
           "Encodes text with a Hugging Face tokenizer (ids on one line) or decodes ids back to text.\n");
    cli_print_options(stdout, tk_options, CLI_NOPTS(tk_options));
}

int cli_tokenize(int argc, char **argv) {
    const char *dir = NULL, *text = NULL, *file = NULL, *ids = NULL, *revision = NULL;
    int decode = 0, tokens = 0, skip_special = 0, no_add = 0;
    for (int i = 0; i < argc; i++) {
        int k;
        const char *v;
        int rc = cli_next_option("tokenize", tk_options, CLI_NOPTS(tk_options), argc, argv, &i, &k, &v);
        if (rc == CLI_HELP) {
            cli_tokenize_help();
            return 0;
        }
        if (rc) return rc;
        switch (k) {
        case TK_TOKENIZER: dir = v; break;
        case TK_TEXT: text = v; break;
        case TK_FILE: file = v; break;
        case TK_IDS: ids = v; break;
        case TK_DECODE: decode = 1; break;
        case TK_TOKENS: tokens = 1; break;
        case TK_SPECIAL: skip_special = 1; break;
        case TK_NO_ADD: no_add = 1; break;
        case TK_REVISION: revision = v; break;
        default: break;
        }
    }
    if (!dir) return cli_fail(2, "tokenize: --tokenizer DIR is required");
    if (decode ? !ids || text || file : (!text == !file) || ids)
        return cli_fail(2, decode ? "tokenize: --decode takes --ids (and no --text/--file)"
                                  : "tokenize: give exactly one of --text or --file (or --decode --ids)");
    ct_err e = {0};
    tok *t = NULL;
    hub_local loc; /* a Hub id -> its snapshot in the cache */
    if (hub_is_repo_id(dir) && access(dir, F_OK) != 0) { /* else tok_load names what is wrong with the path */
        int hrc = hub_resolve(dir, revision, HUB_TOKENIZER, &loc, &e);
        if (hrc) return cli_fail(ct_exit_code(hrc), "%s", e.msg);
        dir = loc.dir;
    }
    int lrc = tok_load(dir, &t, &e);
    if (lrc) return cli_fail(ct_exit_code(lrc), "%s", e.msg); /* a malformed tokenizer.json: 3 */
    int rc = 0;
    if (decode) {
        tok_ids v = {0};
        for (const char *p = ids; *p;) {
            while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') p++;
            if (!*p) break;
            char *end;
            long id = strtol(p, &end, 10);
            if (end == p || id < 0 || id >= tok_vocab_size(t)) {
                rc = cli_fail(2, "--ids: \"%.20s\" is not an id of this tokenizer (0..%d)", p, tok_vocab_size(t) - 1);
                break;
            }
            tok_ids_push(&v, (int32_t)id);
            p = end;
        }
        if (!rc) {
            char *out;
            size_t len;
            tok_decode(t, v.v, v.n, skip_special, &out, &len);
            fwrite(out, 1, len, stdout);
            putchar('\n');
            free(out);
        }
        tok_ids_free(&v);
    } else {
        size_t len = 0;
        char *buf = file ? fs_read_file(file, 0, &len, NULL) : NULL;
        if (file && !buf) rc = cli_fail(1, "%s: cannot read (--file)", file);
        tok_enc *enc = rc ? NULL : tok_enc_new(t);
        tok_ids out = {0};
        if (enc) tok_enc_set_add_special(enc, !no_add);
        if (enc && tok_encode(enc, file ? buf : text, file ? len : strlen(text), &out, &e))
            rc = cli_fail(1, "%s", e.msg);
        for (size_t i = 0; enc && !rc && i < out.n; i++) {
            if (tokens) printf("%d\t%s\n", out.v[i], tok_id_to_token(t, out.v[i]));
            else printf(i ? " %d" : "%d", out.v[i]);
        }
        if (enc && !rc && !tokens) putchar('\n');
        tok_ids_free(&out);
        tok_enc_free(enc);
        free(buf);
    }
    tok_free(t);
    return rc;
}
