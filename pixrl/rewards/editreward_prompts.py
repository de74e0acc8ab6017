"""EditReward's two rubrics (TIGER-AI-Lab/EditReward, EditReward/dataset/prompts.py), the released
text with its trailing spaces: its multi-head models read each edit twice, once under each, and
score each reading with its own head (head_0: instruction following, head_1: visual quality).
The instruction goes in at {text_prompt}."""

FOLLOWING = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Instruction Following & Semantic Fidelity**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how accurately, completely, and exclusively the model executed the given text instruction.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Semantic Accuracy:**  
  Assess whether the edited content accurately captures the semantics of the instruction. The edited result should precisely match the intended meaning. For example, if the instruction is "replace apples with oranges," the object must clearly be oranges, not other fruits.

- **Completeness of Editing:**  
  Check whether **all parts** of the instruction are fully executed. For multi-step edits (e.g., "replace a red car with a blue bicycle"), both the color change and the object replacement must be done without omissions.

- **Exclusivity of Edit (No Over-Editing):**  
  Ensure that only the requested parts are changed. The rest of the image (as seen in the source) should remain unaltered. For example, if the instruction only involves replacing an object, the background, lighting, and unrelated objects should not be unnecessarily modified.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly accurate, complete, and exclusive execution of the instruction.  
- **3 (Relatively Good):** Largely correct, but with minor omissions or slight over-editing.  
- **2 (Relatively Poor):** Major misinterpretation, incomplete edits, or noticeable unintended changes.  
- **1 (Very Poor):** Instruction ignored or completely wrong execution.

Text instruction - {text_prompt}
"""  # noqa: W291 - the released text, trailing spaces included

QUALITY = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Visual Quality & Realism**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how realistic, artifact-free, and aesthetically appealing the edited image is, while remaining consistent with the source image.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Plausibility & Physical Consistency:**  
  Check whether the edit aligns with the laws of physics and the scene context. Lighting, shadows, reflections, perspective, size, and interactions with the environment should all appear natural compared to the source image.

- **Artifact-Free Quality:**  
  Look for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or seams around edited regions. High-quality results should be free from such visible artifacts.

- **Aesthetic Quality:**  
  Evaluate the overall harmony and visual appeal. The image should look natural, balanced, and pleasant. Colors, composition, and atmosphere should enhance the image rather than degrade it.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly realistic, artifact-free, seamless, and aesthetically pleasing.  
- **3 (Relatively Good):** Mostly realistic and clean, with only minor flaws that do not significantly distract.  
- **2 (Relatively Poor):** Noticeable physical inconsistencies or visible artifacts that make the edit unnatural.  
- **1 (Very Poor):** Severe artifacts, incoherent composition, or visually unusable result.

Text instruction - {text_prompt}
"""  # noqa: W291
